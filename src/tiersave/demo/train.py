"""The demo's training worker. Prints one JSON event per line on stdout (loss, save, restore, done).

Run by ``tiersave demo``; also usable alone::

    python -m tiersave.demo.train --ckpt /tmp/ckpt --steps 300 --save-every 25
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from ..checkpointer import Checkpointer
from ..format.checksum import crc32c_hex
from ..rng import RNGState
from ..state import tensor_byte_view
from .model import DataStream, TinyGPT, make_corpus


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def digest(tensors: list[torch.Tensor]) -> str:
    """CRC-32C over the tensors' bytes: equal digests mean bit-identical values."""
    parts = [crc32c_hex(tensor_byte_view(t.detach().contiguous())) for t in tensors]
    return crc32c_hex("".join(parts).encode())


def optimizer_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = optim.state_dict()["state"]
    return [v for k in sorted(state) for _, v in sorted(state[k].items()) if isinstance(v, torch.Tensor)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ckpt", help="checkpoint root (omit: train without checkpoints)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--stop-after", type=int, help="exit cleanly after this step (a planned interruption)")
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # one thread per worker: two workers share the two cores, results stay exact
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    corpus = make_corpus(20_000, seed=args.seed)
    model = TinyGPT(dim=args.dim, layers=args.layers)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    data = DataStream(corpus, block=32, batch=32, seed=args.seed)
    state: dict[str, Any] = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "data": data,
        "rng": RNGState(),
        "step": 0,
    }

    ckpt = Checkpointer(args.ckpt, keep_last=args.keep_last) if args.ckpt else None
    if ckpt is not None and ckpt.latest() is not None:
        t0 = time.perf_counter()
        ckpt.restore(into=state)
        report = ckpt.last_restore
        emit(
            event="restore",
            step=state["step"],
            seconds=time.perf_counter() - t0,
            bytes=report.bytes_read if report else 0,
            skipped=len(report.skipped) if report else 0,
        )
    model.train()
    for step in range(state["step"] + 1, args.steps + 1):
        x, y = data.next_batch()
        loss = model(x, y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        state["step"] = step
        loss_value = loss.item()
        emit(event="loss", step=step, loss=loss_value.hex())
        if ckpt is not None and step % args.save_every == 0:
            # Returns once the state is copied into staging memory; writing goes on in the background.
            handle = ckpt.save_async(step, state, metrics={"loss": loss_value})
            stats = handle.stats
            emit(
                event="save",
                step=step,
                blocked_s=stats.blocked_s,
                bytes=stats.stored_bytes,
                tensors=stats.num_tensors,
            )
        if args.stop_after is not None and step >= args.stop_after:
            break
    emit(
        event="done",
        step=state["step"],
        params=digest(list(model.parameters())),
        optim=digest(optimizer_tensors(optim)),
        lr=sched.get_last_lr()[0],
    )
    if ckpt is not None:
        ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
