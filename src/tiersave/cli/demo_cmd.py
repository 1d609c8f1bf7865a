"""``tiersave demo``: the end-to-end demonstration (train, SIGKILL, resume, compare bit for bit)."""

from __future__ import annotations

import argparse
from typing import Any

from ._common import Output


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small GPT with checkpoints, kill it, resume, and compare bit for bit",
        description="Train a small GPT on the CPU with a checkpoint every N steps, kill the training process "
        "with SIGKILL partway, resume in a new process from the newest checkpoint, and check that the resumed "
        "losses and weights equal an uninterrupted run bit for bit. Takes about a minute.",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--save-every", type=int, default=25, help="checkpoint interval in steps (default 25)")
    p.add_argument("--kill-at", type=int, help="SIGKILL the training process after this step (default: ~57%%)")
    p.add_argument("--keep-last", type=int, help="retention: keep this many newest checkpoints")
    p.add_argument("--dir", help="working directory (default: a new temporary directory)")
    p.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace, out: Output) -> int:
    from ..demo.run import main

    return main(
        steps=args.steps,
        save_every=args.save_every,
        kill_at=args.kill_at,
        directory=args.dir,
        keep_last=args.keep_last,
    )
