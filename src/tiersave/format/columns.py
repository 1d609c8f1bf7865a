"""Column-wise checks of a manifest's tensor table, and the helpers the compact table (``compact.py``) shares.

A manifest of 10^5 tensors has 10^5 entries of six fields each. Checking them entry by entry in Python costs a
few microseconds per tensor; checking them field by field, each field a list whose per-value work runs in C
(``map``, ``set``, ``min``, ``max``, list comparison), costs a fraction of that. These functions only ever
*accept*: each returns None (or False) as soon as anything is not exactly what a well-formed manifest
holds, and the caller then runs the entry-by-entry checks, which find the first faulty entry and name it.
So a valid manifest is accepted with the same values, and an invalid one fails with the same error.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Sequence
from itertools import accumulate, chain, compress, pairwise, repeat
from typing import Any

from ..errors import FormatError
from .dtypes import DTYPES

ITEMSIZE = {name: d.itemsize for name, d in DTYPES.items()}
_FIELDS = ("dtype", "shape", "shard", "offset", "nbytes", "crc32c")
HEX = re.compile("[0-9a-f]*")
"""Lowercase hex digits, matched (``fullmatch``) against every checksum of a table joined: one scan in C."""
_INT = {int}  # type(x) is int: a bool is not an integer here, as in every other check of the manifest

Fail = Callable[[str], FormatError]
"""Makes the error of a failed check (its message prefixed with the manifest's path)."""
Columns = tuple[list[str], list[str], list[tuple[int, ...]], list[int], list[int], list[int], list[tuple[str, ...]]]
"""names, dtypes, shapes, shards, offsets, nbytes, crc32c lists: the fields of ``TensorEntry`` in order."""


def ints(values: Any, lo: int, hi: int) -> bool:
    """``values`` is a list of ints (not bools) in [lo, hi]; True for an empty list."""
    if type(values) is not list:
        return False
    return not values or (set(map(type, values)) == _INT and min(values) >= lo and max(values) <= hi)


def chunk_counts(nbytes: list[int], chunk_bytes: int) -> list[int]:
    """``ceil(n / chunk_bytes)`` for each ``n``: the checksums of each tensor (docs/format.md 4, Chunks)."""
    return list(map(operator.neg, map(operator.floordiv, map(operator.neg, nbytes), repeat(chunk_bytes))))


def tensor_columns(
    raw: dict[str, Any],
    nshards: int,
    chunk_bytes: int,
    *,
    fields: frozenset[str],
    max_ndim: int,
    max_name: int,
    max_int: int,
) -> Columns | None:
    """The checked fields of every entry of ``raw`` (the manifest's ``tensors`` object), or None when any
    entry is not a well-formed one (docs/format.md 4.2 steps 4-5 and the per-tensor part of 4): exactly
    the known fields, a known dtype, at most ``max_ndim`` dimensions in [0, max_int], a shard index below
    ``nshards``, an offset in [0, max_int], ``nbytes == prod(shape) * itemsize <= max_int`` and one
    8-hex-digit checksum per chunk."""
    names = list(raw)
    entries = list(raw.values())
    if not entries or set(map(type, entries)) != {dict}:
        return None
    if not all(map(operator.eq, map(dict.keys, entries), repeat(fields))):
        return None
    if min(map(len, names)) < 1 or max(map(len, names)) > max_name or any(map(operator.contains, names, repeat("\0"))):
        return None
    dtypes, shapes, shards, offsets, nbytes, crcs = (list(map(operator.itemgetter(f), entries)) for f in _FIELDS)
    if set(map(type, dtypes)) != {str} or not set(dtypes) <= ITEMSIZE.keys():
        return None
    if set(map(type, shapes)) != {list} or max(map(len, shapes)) > max_ndim:
        return None
    if not ints(list(chain.from_iterable(shapes)), 0, max_int):
        return None
    if not (ints(shards, 0, nshards - 1) and ints(offsets, 0, max_int) and ints(nbytes, 0, max_int)):
        return None
    # Exact integers: prod(shape) * itemsize cannot overflow, and == on lists of ints compares values.
    if list(map(operator.mul, map(math.prod, shapes), map(ITEMSIZE.__getitem__, dtypes))) != nbytes:
        return None
    if set(map(type, crcs)) != {list}:
        return None
    if list(map(len, crcs)) != chunk_counts(nbytes, chunk_bytes):
        return None
    flat = list(chain.from_iterable(crcs))
    # All 8 characters long, then one scan of them joined: what the per-entry ``_HEX8`` accepts (an entry
    # that fails takes the per-entry path, which names it).
    if flat and (set(map(type, flat)) != {str} or set(map(len, flat)) != {8} or not HEX.fullmatch("".join(flat))):
        return None
    return names, dtypes, list(map(tuple, shapes)), shards, offsets, nbytes, list(map(tuple, crcs))


def ranges_ok(sizes: Sequence[int], shards: list[int], offsets: list[int], nbytes: list[int], align: int) -> bool:
    """True when every tensor's offset is ``align``-aligned, its range lies inside its shard (``sizes``,
    indexed by ``shards``) and no two non-empty ranges of one shard overlap (docs/format.md 4.2 steps 5-6).

    The overlap check is one sort: each range is moved to a global position (its shard's start in the
    concatenation of all shards, which are disjoint once every range is inside its shard), and after sorting
    by start, two ranges overlap if and only if some range starts before the end of the one sorted just
    before it."""
    if not shards:
        return True
    if min(shards) < 0 or max(shards) >= len(sizes) or min(offsets) < 0 or min(nbytes) < 0:
        return False
    if any(map(operator.mod, offsets, repeat(align))):
        return False
    ends = list(map(operator.add, offsets, nbytes))
    if any(map(operator.gt, ends, map(sizes.__getitem__, shards))):
        return False
    bases = list(accumulate(sizes, initial=0))
    starts = list(map(operator.add, map(bases.__getitem__, shards), offsets))
    nonempty = list(map(bool, nbytes))
    starts = list(compress(starts, nonempty))
    ends = list(map(operator.add, starts, compress(nbytes, nonempty)))
    if not all(map(operator.le, starts, starts[1:])):  # a writer lays tensors out in order: rarely taken
        pairs = sorted(zip(starts, ends))
        starts, ends = [s for s, _ in pairs], [e for _, e in pairs]
    return not any(map(operator.lt, starts[1:], ends))


def first_range_fault(entries: Sequence[Any], shards: Sequence[tuple[str, int]], align: int) -> str:
    """Entry by entry: the message naming the first tensor whose range is wrong, once :func:`ranges_ok` said
    one is. ``entries`` have ``name``, ``shard``, ``offset`` and ``nbytes``; ``shards`` are (file, size)."""
    by_shard: dict[int, list[tuple[int, int, str]]] = {}
    for t in entries:
        if t.offset % align:
            return f"tensor {t.name!r} offset {t.offset} is not {align}-aligned"
        if t.shard >= len(shards):
            return f"tensor {t.name!r} refers to missing shard {t.shard}"
        file, size = shards[t.shard]
        if t.offset + t.nbytes > size:
            return f"tensor {t.name!r} range [{t.offset}, {t.offset + t.nbytes}) exceeds shard {file} of {size} bytes"
        if t.nbytes:
            by_shard.setdefault(t.shard, []).append((t.offset, t.offset + t.nbytes, t.name))
    for ranges in by_shard.values():
        ranges.sort()
        for (_, end, a), (start, _, b) in pairwise(ranges):
            if start < end:
                return f"tensors {a!r} and {b!r} overlap in their shard"
    return "a tensor's byte range is wrong"  # unreachable while ranges_ok and this agree
