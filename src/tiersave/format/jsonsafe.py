"""Strict JSON for untrusted manifests: bounded size and depth, no NaN, no duplicate keys."""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import FormatError

MAX_DEPTH = 512


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def loads_strict(data: bytes, *, what: str, max_bytes: int) -> Any:
    """Parse ``data`` as strict JSON or raise :class:`FormatError` naming ``what``.

    Rejects: more than ``max_bytes``, invalid UTF-8, NaN/Infinity, duplicate keys, nesting deeper than
    :data:`MAX_DEPTH`, and integers too long to convert.
    """
    if len(data) > max_bytes:
        raise FormatError(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit", path=what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{what} is not valid UTF-8: {exc}", path=what) from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except RecursionError:
        raise FormatError(f"{what} is nested too deeply", path=what) from None
    except ValueError as exc:  # JSONDecodeError, duplicate keys, constants, huge integers
        raise FormatError(f"{what} is not valid JSON: {exc}", path=what) from None
    check_depth(value, what=what)
    return value


def check_depth(value: Any, *, what: str, limit: int = MAX_DEPTH) -> None:
    """Raise :class:`FormatError` if ``value`` nests lists/dicts deeper than ``limit``."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            raise FormatError(f"{what} is nested deeper than {limit} levels", path=what)
        stack.extend((child, depth + 1) for child in children)


def dumps_canonical(value: Any) -> bytes:
    """Serialize to compact UTF-8 JSON; refuses NaN/Infinity so what we write we can read back."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
