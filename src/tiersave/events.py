"""What background work reports: the save event log, and warnings raised from background threads.

The event log has one JSON line per save (committed, failed or skipped) with its timings, and one per
drain to a later tier.

Lives at ``ROOT/tiersave-events.jsonl`` for a local root. Each record is appended with a single
``O_APPEND`` write, so concurrent writers never interleave within a line; the log is informational
(``tiersave stats``), never used to decide what is committed. It is rotated to ``.1`` past 16 MiB.
Torch-free.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import warnings
from pathlib import Path
from typing import Any

from .errors import TiersaveWarning

log = logging.getLogger(__name__)

EVENTS_NAME = "tiersave-events.jsonl"
_ROTATE_BYTES = 16 << 20


class EventLog:
    """Appends save records to a JSON-lines file. Thread-safe (one ``write`` per record)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode()
        try:
            try:
                if self.path.stat().st_size > _ROTATE_BYTES:
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            except FileNotFoundError:
                pass
            # never blocks (a FIFO put there has no reader) and never follows a link; only a regular file is written
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW
            fd = os.open(self.path, flags, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError(f"{self.path} is not a regular file")
                os.write(fd, line)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:  # statistics must never fail a save
            log.warning("could not append to the event log %s: %s", self.path, exc)


def _finite(text: str) -> float:
    """A number of an event record (NaN, Infinity or 1e999 included, which no writer here puts there), or
    ValueError for one that is not finite: such a record could not be printed again as strict JSON."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is not finite")
    return value


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of the log (and its rotated predecessor), oldest first; malformed lines are skipped."""
    base = Path(path)
    records: list[dict[str, Any]] = []
    for p in (base.with_name(base.name + ".1"), base):
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            try:
                value = json.loads(line, parse_constant=_finite, parse_float=_finite)
            except ValueError:  # a torn or damaged line; NaN or 1e999 too, which no writer here puts there
                continue
            if isinstance(value, dict):
                records.append(value)
    return records


def background_warning(message: str) -> None:
    """Warn from a background thread: logged always, and a ``TiersaveWarning`` unless warnings are
    configured as errors (an exception here would kill the thread doing the work, not reach the user)."""
    log.warning("%s", message)
    try:
        warnings.warn(message, TiersaveWarning, stacklevel=2)
    except Warning:
        pass


def drained_event(
    seconds: float,
    stored_bytes: int,
    file_bytes: int,
    *,
    written_bytes: int | None = None,
    referenced_bytes: int | None = None,
) -> dict[str, Any]:
    """The sizes and speed of a ``drained`` event (``written_bytes``: what this process wrote, for the speed;
    the stored bytes by default), one form for the chain's drains and the part drains (``tiersave stats``)."""
    written = stored_bytes if written_bytes is None else written_bytes
    event: dict[str, Any] = {
        "total_s": round(seconds, 6),
        "stored_bytes": stored_bytes,
        "file_bytes": file_bytes,  # fewer when compressed
        "write_gbps": round(written / seconds / 1e9, 4) if seconds > 0 else 0.0,
    }
    if referenced_bytes is not None:
        event["referenced_bytes"] = referenced_bytes  # not copied again
    return event
