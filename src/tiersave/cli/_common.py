"""Helpers shared by the CLI commands: output in text or JSON, errors, exit codes."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


@dataclass
class Output:
    """Where a command writes its result: human text, or one JSON document on stdout with ``--json``."""

    json: bool = False

    def emit(self, data: Any, text: str) -> None:
        """Print ``data`` as JSON when ``--json`` was given, else ``text``."""
        if self.json:
            sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n")
        elif text:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()

    def progress(self, message: str) -> None:
        """A progress line on stderr (never mixed into the JSON on stdout)."""
        if sys.stderr.isatty() or not self.json:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")


def report_error(out: Output, exc: BaseException) -> None:
    """Print a failure as ``tiersave: error: ...`` on stderr, and as JSON on stdout with ``--json``."""
    kind = type(exc).__name__
    message = str(exc) or kind
    if out.json:
        sys.stdout.write(json.dumps({"error": {"type": kind, "message": message}}) + "\n")
    sys.stderr.write(f"tiersave: error: {message}\n")
