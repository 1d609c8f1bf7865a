"""The ``tiersave`` command line.

``main(argv) -> int`` is the whole entry point, testable without a subprocess. Each command lives in its
own module under ``tiersave.cli`` and exposes ``register(subparsers)``; those modules import only the
standard library at import time, so ``tiersave --help`` and ``tiersave plan`` start without torch.

Exit codes: 0 success, 1 the operation failed (including a verification that found damage),
2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .._version import __version__
from ._common import EXIT_FAILURE, EXIT_USAGE, Output, report_error

__all__ = ["main"]

# Order here is the order in `tiersave --help`.
_COMMAND_MODULES = (
    "tiersave.cli.demo_cmd",
    "tiersave.cli.inspect_cmds",
    "tiersave.cli.export_cmd",
    "tiersave.cli.prune_cmd",
    "tiersave.cli.copy_cmd",
    "tiersave.cli.stats_cmd",
    "tiersave.cli.watch_cmd",
    "tiersave.cli.tag_cmd",
    "tiersave.cli.plan_cmd",
    "tiersave.cli.simulate_cmd",
    "tiersave.cli.bench_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="tiersave",
        description="Fast, stall-free, tiered checkpointing for PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"tiersave {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (repeat for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # a command module that is not part of this build
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return the process exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse: --help/--version (0) or a usage error (2)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_USAGE
    if not getattr(args, "handler", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.verbose:
        import logging

        logging.basicConfig(
            level=logging.DEBUG if args.verbose > 1 else logging.INFO,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
    out = Output(json=bool(getattr(args, "json", False)))
    try:
        return int(args.handler(args, out))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # every failure becomes a message and an exit code, never a traceback
        report_error(out, exc)
        from ..errors import ConfigError

        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE
