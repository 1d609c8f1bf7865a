"""Transfer learning from a checkpoint: a new model with a new head takes the pretrained encoder's weights.

Pretraining (10 classes) saves full checkpoints (model, optimizer, step). Fine-tuning builds a model for another
task (3 classes): ``restore(into={"model": model}, strict=False)`` reads only the model's tensors that the new
model can take (not the optimizer, not the old head), loads them, and reports what it left out, in
``ckpt.last_restore`` and a log line. ``cast=True`` does the same into a bfloat16 copy of the model.

    python examples/transfer_learning.py --dir /tmp/tl
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
from _common import Batches, Classifier, dataset

import tiersave


def pretrain(ckpt: tiersave.Checkpointer, steps: int) -> None:
    torch.manual_seed(0)
    model = Classifier(classes=10)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = Batches(dataset(2048, classes=10))
    for _ in range(steps):
        x, y = batches.next()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optim.zero_grad()
        loss.backward()
        optim.step()
    ckpt.save(steps, {"model": model, "optim": optim, "step": steps}, metrics={"loss": loss.item()})
    print(f"pretrained {steps} steps on 10 classes, loss {loss.item():.4f}")


def accuracy(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float((model(data[0].to(next(model.parameters()).dtype)).argmax(1) == data[1]).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="run directory (checkpoints in DIR/pretrain)")
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    with tiersave.Checkpointer(os.path.join(args.dir, "pretrain")) as ckpt:
        if ckpt.latest() is None:
            pretrain(ckpt, args.steps)

        # A new task: 3 classes. The encoder transfers, the head is new.
        torch.manual_seed(1)
        model = Classifier(classes=3)
        ckpt.restore(into={"model": model}, strict=False)
        report = ckpt.last_restore
        print(f"loaded step {report.step}: read {report.bytes_read} bytes (the encoder only)")
        print(f"  shape-mismatched, left as initialized: {report.mismatched}")
        print(f"  missing from the checkpoint: {report.missing}")

        # Fine-tune the head (the encoder frozen) on the new task.
        train, test = dataset(1024, classes=3, seed=5), dataset(512, classes=3, seed=6)
        for p in model.encoder.parameters():
            p.requires_grad_(False)
        optim = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
        batches = Batches(train)
        for _ in range(args.steps):
            x, y = batches.next()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
        print(f"fine-tuned the new head: test accuracy {accuracy(model, test):.2f}")

        # The same weights into a bfloat16 model: a dtype change is refused unless asked for.
        half = Classifier(classes=3).to(torch.bfloat16)
        try:
            ckpt.restore(into={"model": half}, strict=False)
        except tiersave.StateMismatchError as exc:
            print(f"without cast=True: {exc}")
        ckpt.restore(into={"model": half}, strict=False, cast=True)
        print(f"with cast=True: {len(ckpt.last_restore.cast)} tensors converted to bfloat16")

        # Just the encoder's tensors, as a new tree, without a model to load them into.
        encoder = ckpt.restore(keys=["model.encoder"])["model"]
        print(f"keys=['model.encoder']: {sorted(encoder)} ({ckpt.last_restore.bytes_read} bytes read)")


if __name__ == "__main__":
    main()
