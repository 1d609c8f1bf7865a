"""Units a person types and reads: durations (``"4h"``, ``"1h30m"``) and byte and count quantities
(``"130GiB"``, ``"13GB/s"``, ``"405B"``), and the plain-text table that reports print them in.

Scope: parsing those strings strictly (a malformed one is a ``ConfigError`` with examples) and formatting
numbers back with a unit. Anti-scope: everything else; this is a leaf that the planner, the storage options
(timeouts, part sizes) and the CLI share, so it imports only the standard library and the error tree.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from .errors import ConfigError

__all__ = [
    "SECONDS_PER_DAY",
    "format_duration",
    "format_si_bytes",
    "human_bytes",
    "ordinal",
    "parse_bytes",
    "parse_count",
    "parse_duration",
    "table",
]

SECONDS_PER_DAY = 86_400.0

# ------------------------------------------------------------------------------------------------ durations

_UNIT_SECONDS = {
    "ms": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hrs": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": SECONDS_PER_DAY,
    "day": SECONDS_PER_DAY,
    "days": SECONDS_PER_DAY,
    "y": 365.25 * SECONDS_PER_DAY,
    "year": 365.25 * SECONDS_PER_DAY,
    "years": 365.25 * SECONDS_PER_DAY,
}
_DURATION_NUMBER = r"[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?"
_PART_RE = re.compile(rf"({_DURATION_NUMBER})([a-z]+)")
_DURATION_RE = re.compile(rf"(?:{_DURATION_NUMBER}[a-z]+)+")


def parse_duration(text: str | float) -> float:
    """Parse a duration to seconds: ``"124min"``, ``"4h"``, ``"1h30m"``, ``"90s"``, ``"2.5d"``, ``"600"``.

    A bare number is seconds. Units: ms, s, m/min, h, d, y (365.25 days).

    Raises:
        ConfigError: malformed, negative or not finite.
    """
    if isinstance(text, bool):
        raise ConfigError(f"cannot read {text!r} as a duration")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        compact = text.strip().lower().replace(" ", "")
        try:
            seconds = float(compact)
        except ValueError:
            if not _DURATION_RE.fullmatch(compact):
                raise ConfigError(
                    f"cannot read {text!r} as a duration (examples: 600, 90s, 124min, 4h, 1h30m, 2d)"
                ) from None
            parts = _PART_RE.findall(compact)
            unknown = sorted({unit for _, unit in parts if unit not in _UNIT_SECONDS})
            if unknown:
                raise ConfigError(
                    f"duration {text!r}: unknown unit {', '.join(unknown)}; use ms, s, min, h, d or y"
                ) from None
            seconds = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"a duration must be finite and >= 0, got {text!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """Format seconds with a unit a person reads at a glance: ``"120 s"``, ``"6.2 min"``, ``"4 h"``."""
    for limit, unit, scale in (
        (120.0, "s", 1.0),
        (3 * 3600.0, "min", 60.0),
        (3 * SECONDS_PER_DAY, "h", 3600.0),
        (730 * SECONDS_PER_DAY, "d", SECONDS_PER_DAY),
    ):
        if seconds < limit:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / _UNIT_SECONDS['y']:.3g} y"


# ------------------------------------------------------------------------------------- bytes and counts

_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"
_BYTES_RE = re.compile(rf"^\s*{_NUMBER}\s*((?:[kmgtpe]i?)?)(?:b|byte|bytes)?\s*(?:/s)?\s*$")
_BYTE_UNITS = {
    **{prefix: 1000**i for i, prefix in enumerate(("", "k", "m", "g", "t", "p", "e"))},
    **{prefix + "i": 1024**i for i, prefix in enumerate(("", "k", "m", "g", "t", "p", "e")) if prefix},
}
_COUNT_RE = re.compile(rf"^\s*{_NUMBER}\s*([kmbt]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def _parse_quantity(text: str, pattern: re.Pattern[str], units: Mapping[str, int], what: str, examples: str) -> int:
    match = pattern.match(text.lower())
    if match is None:
        raise ConfigError(f"cannot read {text!r} as {what} (examples: {examples})")
    value = round(float(match.group(1)) * units[match.group(2)])
    if value < 1:
        raise ConfigError(f"{what} must be at least 1, got {text!r}")
    return value


def parse_bytes(text: str) -> int:
    """Parse a byte quantity: ``"5TB"`` (decimal), ``"130GiB"`` (binary), ``"4096"``, ``"13GB/s"``.

    Raises:
        ConfigError: malformed, or less than one byte.
    """
    return _parse_quantity(text, _BYTES_RE, _BYTE_UNITS, "a byte quantity", "4096, 130GiB, 5TB, 13GB/s")


def parse_count(text: str) -> int:
    """Parse a parameter count: ``"405B"`` (billions), ``"70.6e9"``, ``"124M"``, ``"1.5T"``.

    Raises:
        ConfigError: malformed, zero or negative.
    """
    return _parse_quantity(text, _COUNT_RE, _COUNT_UNITS, "a parameter count", "124M, 8B, 70.6e9")


def format_si_bytes(n: float, suffix: str = "") -> str:
    """Format bytes with decimal units, as storage vendors quote them: ``4.87 TB``, ``13.1 GB/s``.

    Args:
        n: bytes (or bytes per second).
        suffix: appended to the unit, e.g. ``"/s"``.
    """
    units = ("B", "kB", "MB", "GB", "TB", "PB", "EB")
    exponent = 0 if n < 1000 else min(int(math.log10(n) // 3), len(units) - 1)
    scaled = n / 1000**exponent
    if exponent == 0:
        return f"{scaled:.0f} {units[0]}{suffix}"
    digits = 2 if scaled < 10 else 1 if scaled < 100 else 0
    return f"{scaled:.{digits}f} {units[exponent]}{suffix}"


def human_bytes(n: float) -> str:
    """Format a byte count with binary units: ``1.5 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Render a plain-text table with left-aligned columns."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(row.rstrip() for row in [line, sep, *body])


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``22nd``..."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
