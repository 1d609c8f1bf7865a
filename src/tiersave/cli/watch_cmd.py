"""``tiersave watch``: print each checkpoint committed under a root as it appears (one line, or JSON lines), or
each move of a movable tag (``--tag``); ``--exec`` runs a command for each."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from typing import Any

from ._common import EXIT_FAILURE, EXIT_OK, Output, add_json_flag, positive_int


def register(sub: Any) -> None:
    p = sub.add_parser(
        "watch",
        help="print each newly committed checkpoint (or each move of a tag) as it appears",
        description="Follow a checkpoint root and print each newly committed checkpoint (never a partial "
        "one), or with --tag each checkpoint a movable tag is moved to. Examples: "
        "tiersave watch /ckpt/run1 --count 1 --timeout 600; "
        "tiersave watch /ckpt/run1 --tag serving --exec 'python reload.py --step {step} --uri {uri}'",
    )
    p.add_argument("root")
    p.add_argument(
        "--all", action="store_true", help="also print the checkpoints already committed (the tag's current one)"
    )
    p.add_argument("--tag", help="follow this movable tag (tiersave tag) instead of every new checkpoint")
    p.add_argument(
        "--exec",
        dest="command",
        metavar="CMD",
        help="run CMD for each checkpoint ({step} and {uri} substituted; split like a shell, run without one)",
    )
    p.add_argument("--exec-timeout", type=float, default=3600.0, help="seconds CMD may run (default 3600)")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between looks (default 1)")
    p.add_argument("--timeout", type=float, help="stop when nothing new appeared for this many seconds")
    p.add_argument("--count", type=positive_int, help="stop after this many checkpoints")
    add_json_flag(p)
    p.set_defaults(handler=_watch)


def _watch(args: argparse.Namespace, out: Output) -> int:
    from ..errors import ConfigError
    from ..watch import watch

    argv = shlex.split(args.command) if args.command is not None else None
    if argv is not None and not argv:
        raise ConfigError("--exec needs a command")
    if not args.exec_timeout > 0:
        raise ConfigError(f"--exec-timeout must be a positive number of seconds, got {args.exec_timeout!r}")
    feed = watch(args.root, include_existing=args.all, poll_s=args.poll, timeout_s=args.timeout, tag=args.tag)
    try:
        return _follow(feed, args, argv, out)
    finally:
        close = getattr(feed, "close", None)  # drops the read lease of the checkpoint last handled
        if close is not None:
            close()


def _follow(feed: Any, args: argparse.Namespace, argv: list[str] | None, out: Output) -> int:
    """Print (and with --exec, run the command for) each checkpoint of ``feed``; the feed's read lease holds
    the checkpoint while the command runs."""
    failed = 0
    for seen, info in enumerate(feed, start=1):
        data = info.to_json()
        if out.json:  # one JSON document per line, flushed, for a consumer reading a pipe
            sys.stdout.write(json.dumps(data) + "\n")
        else:
            sys.stdout.write(f"step {info.step} committed {info.created_at}\n")
        sys.stdout.flush()
        if argv is not None:
            failed += not _run(argv, info.step, info.location, args.exec_timeout)
        if args.count is not None and seen >= args.count:
            break
    return EXIT_FAILURE if failed else EXIT_OK


def _run(argv: list[str], step: int, uri: str, timeout_s: float) -> bool:
    """Run the ``--exec`` command for one checkpoint; a failure is reported on stderr, and the feed goes on
    (the exit code of ``tiersave watch`` is then 1)."""
    command = [a.replace("{step}", str(step)).replace("{uri}", uri) for a in argv]
    try:
        code = subprocess.run(command, timeout=timeout_s, check=False).returncode
    except subprocess.TimeoutExpired:
        sys.stderr.write(f"tiersave: --exec for step {step} ran past {timeout_s:g} s and was killed\n")
        return False
    except OSError as exc:
        sys.stderr.write(f"tiersave: --exec for step {step} could not start {command[0]!r}: {exc}\n")
        return False
    if code != 0:
        sys.stderr.write(f"tiersave: --exec for step {step} exited with status {code}\n")
    return code == 0
