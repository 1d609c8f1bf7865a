"""``tiersave watch``: print each checkpoint committed under a root as it appears (one line, or JSON lines)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ._common import EXIT_OK, Output, add_json_flag, positive_int


def register(sub: Any) -> None:
    p = sub.add_parser(
        "watch",
        help="print each newly committed checkpoint as it appears",
        description="Follow a checkpoint root and print each newly committed checkpoint (never a partial "
        "one). Example: tiersave watch /ckpt/run1 --count 1 --timeout 600",
    )
    p.add_argument("root")
    p.add_argument("--all", action="store_true", help="also print the checkpoints already committed")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between looks (default 1)")
    p.add_argument("--timeout", type=float, help="stop when nothing new appeared for this many seconds")
    p.add_argument("--count", type=positive_int, help="stop after this many checkpoints")
    add_json_flag(p)
    p.set_defaults(handler=_watch)


def _watch(args: argparse.Namespace, out: Output) -> int:
    from ..watch import watch

    feed = watch(args.root, include_existing=args.all, poll_s=args.poll, timeout_s=args.timeout)
    for seen, info in enumerate(feed, start=1):
        data = info.to_json()
        if out.json:  # one JSON document per line, flushed, for a consumer reading a pipe
            sys.stdout.write(json.dumps(data) + "\n")
        else:
            sys.stdout.write(f"step {info.step} committed {info.created_at}\n")
        sys.stdout.flush()
        if args.count is not None and seen >= args.count:
            break
    return EXIT_OK
