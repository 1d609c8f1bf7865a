"""Helpers shared by the CLI commands: output in text or JSON, errors, exit codes."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

from ..units import human_bytes

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


class ByteProgress:
    """A one-line byte progress bar on stderr for long reads and copies (``verify``, ``copy``).

    Shown only when stderr is a terminal and the output is not ``--json``: a pipe or a log file gets
    nothing extra. Redrawn at most ten times a second, in place (carriage return); :meth:`close` ends the
    line. ``update`` may be called from several threads.
    """

    def __init__(self, out: Output, label: str, *, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = not out.json and self.stream.isatty()
        self.label = label
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._drawn = 0.0
        self._shown = False

    def update(self, done: int, total: int) -> None:
        """Show ``done`` of ``total`` bytes."""
        if not self.enabled:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._drawn < 0.1 and done < total:
                return
            self._drawn = now
            frac = min(1.0, done / total) if total > 0 else 1.0
            bar = "#" * int(24 * frac)
            rate = done / max(now - self._start, 1e-6)
            self.stream.write(
                f"\r{self.label} [{bar:.<24}] {human_bytes(done)} / {human_bytes(total)} {100 * frac:3.0f}% "
                f"{human_bytes(int(rate))}/s\x1b[K"
            )
            self.stream.flush()
            self._shown = True

    def close(self) -> None:
        """End the bar's line (nothing when it was never shown)."""
        with self._lock:
            if self._shown:
                self.stream.write("\n")
                self.stream.flush()
                self._shown = False


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
