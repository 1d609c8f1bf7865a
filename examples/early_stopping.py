"""Early stopping: keep the best checkpoint by validation loss while rotating the rest, stop when validation
stops improving, and go back to the best with ``restore(tag="best")``.

Each evaluation saves a checkpoint with its ``val_loss``; an improvement is tagged ``"best"``. The retention
``keep="last=2,best=1:val_loss:min"`` keeps the two newest and the best, so the best survives however long
training goes on past it (a plain "keep the last N" would delete it).

    python examples/early_stopping.py --dir /tmp/es
    tiersave ls /tmp/es/ckpt          # the last 2 and the best
"""

from __future__ import annotations

import argparse
import os

import torch
from _common import Batches, Classifier, dataset

import tiersave
from tiersave import Tier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="run directory (checkpoints in DIR/ckpt)")
    parser.add_argument("--max-evals", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--patience", type=int, default=3, help="evaluations without improvement before stopping")
    args = parser.parse_args()

    torch.manual_seed(0)
    # Few training points and a wide model: it overfits, and validation loss turns back up.
    model = Classifier(classes=10, width=256)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train, val = Batches(dataset(96, seed=1), batch=32), dataset(1024, seed=2)
    state = {"model": model, "optim": optim, "data": train, "step": 0}

    best, since_best = float("inf"), 0
    keep = "last=2,best=1:val_loss:min"
    with tiersave.Checkpointer(tiers=[Tier(os.path.join(args.dir, "ckpt"), keep=keep)]) as ckpt:
        for _ in range(args.max_evals):
            for _step in range(args.eval_every):
                x, y = train.next()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optim.zero_grad()
                loss.backward()
                optim.step()
                state["step"] += 1
            with torch.no_grad():
                val_loss = torch.nn.functional.cross_entropy(model(val[0]), val[1]).item()
            improved = val_loss < best
            ckpt.save_async(state["step"], state, metrics={"val_loss": val_loss}, tags=["best"] if improved else [])
            best, since_best = (val_loss, 0) if improved else (best, since_best + 1)
            print(f"step {state['step']}: val_loss {val_loss:.4f}{' (best)' if improved else ''}")
            if since_best >= args.patience:
                print(f"no improvement in {args.patience} evaluations: stopping at step {state['step']}")
                break
        ckpt.wait()
        ckpt.restore(tag="best", into={"model": model})  # only the model's bytes are read
        with torch.no_grad():
            restored = torch.nn.functional.cross_entropy(model(val[0]), val[1]).item()
        print(f"restored the best checkpoint, step {ckpt.last_restore.step}: val_loss {restored:.4f}")
        print(f"kept: {', '.join(str(i.step) + (' (best)' if 'best' in i.tags else '') for i in ckpt.list())}")


if __name__ == "__main__":
    main()
