"""Strict JSON for untrusted manifests: bounded size and depth, no NaN, no duplicate keys; and
:func:`paused_gc` for the code that builds a manifest's (or a state's) many small objects."""

from __future__ import annotations

import gc
import json
import math
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain, compress, repeat
from typing import Any, cast

from ..errors import FormatError

MAX_DEPTH = 512


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # in C; a manifest of 10^5 tensors has 2 * 10^5 objects
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 reads as inf: what we could never write, nor hash to check a seal
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads_strict(data: bytes, *, what: str, max_bytes: int, defer_depth: tuple[str, ...] = ()) -> Any:
    """Parse ``data`` as strict JSON or raise :class:`FormatError` naming ``what``.

    Rejects: more than ``max_bytes``, invalid UTF-8, NaN/Infinity and numbers beyond a float's range (which
    would read as infinite), duplicate keys, nesting deeper than :data:`MAX_DEPTH`, and integers too long to
    convert. ``defer_depth``: top-level keys whose values' depth
    the caller checks before walking it in Python (see :func:`check_depth`).
    """
    if len(data) > max_bytes:
        raise FormatError(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit", path=what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{what} is not valid UTF-8: {exc}", path=what) from None
    try:
        value = json.loads(
            text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants, parse_float=_finite_float
        )
    except RecursionError:
        raise FormatError(f"{what} is nested too deeply", path=what) from None
    except ValueError as exc:  # JSONDecodeError, duplicate keys, constants, huge numbers
        raise FormatError(f"{what} is not valid JSON: {exc}", path=what) from None
    check_depth(value, what=what, skip=defer_depth)
    return value


def check_depth(value: Any, *, what: str, limit: int = MAX_DEPTH, start: int = 1, skip: tuple[str, ...] = ()) -> None:
    """Raise :class:`FormatError` if ``value`` nests lists/dicts deeper than ``limit``, counting ``value`` itself
    as level ``start`` (a subtree checked on its own). ``skip``: keys of a top-level object whose values are
    left out, for a caller that checks that subtree itself (``check_depth(..., start=2)``) or proves its
    depth some cheaper way."""
    if skip and type(value) is dict:
        value = {key: child for key, child in value.items() if key not in skip}
    # Level by level, with the per-value work in C (chain, map, compress): a manifest of 10^5 tensors has
    # 10^6 scalars (shapes, offsets, checksums) that are never touched one by one in Python.
    level = [value] if isinstance(value, _CONTAINERS) else []
    depth = start
    while level:
        if depth > limit:
            raise FormatError(f"{what} is nested deeper than {limit} levels", path=what)
        is_dict = list(map(isinstance, level, repeat(dict)))
        dicts = cast("Iterator[dict[str, Any]]", compress(level, is_dict))
        lists = compress(level, map(operator.not_, is_dict))
        children = list(chain(chain.from_iterable(map(dict.values, dicts)), chain.from_iterable(lists)))
        level = list(compress(children, map(isinstance, children, repeat(_CONTAINERS))))
        depth += 1


_CONTAINERS = (dict, list)


def dumps_canonical(value: Any) -> bytes:
    """Serialize to compact UTF-8 JSON; refuses NaN/Infinity so what we write we can read back."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a block allocates very many small acyclic objects.

    A manifest of 10^5 tensors is 10^6 dicts, lists, strings and tuples; each allocation burst triggers
    collections that rescan every object alive (measured: a third of a restore's CPU time). The objects built
    here hold no reference cycles, so nothing is lost by collecting later. Re-entrant; a collector that the
    process had disabled stays disabled.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
