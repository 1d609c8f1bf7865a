"""Argument checks shared by the planner modules, so every rejected input reads the same way.

Scope: validate a positive finite number, a finite number >= 0 and a positive integer, and raise
:class:`~tiersave.errors.ConfigError` naming the argument and the value.

Anti-scope: parsing text (that is :mod:`tiersave.units`), defaults, any planner arithmetic.
"""

from __future__ import annotations

import math

from ..errors import ConfigError

__all__ = ["require_count", "require_non_negative", "require_positive"]


def require_positive(what: str, value: float) -> float:
    """``value`` as a float when it is a positive finite number (bools refused).

    Raises:
        ConfigError: anything else, naming ``what``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def require_non_negative(what: str, value: float) -> float:
    """``value`` as a float when it is a finite number >= 0 (bools refused).

    Raises:
        ConfigError: anything else, naming ``what``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def require_count(what: str, value: object) -> int:
    """``value`` when it is an integer >= 1 (bools and floats refused).

    Raises:
        ConfigError: anything else, naming ``what``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return value
