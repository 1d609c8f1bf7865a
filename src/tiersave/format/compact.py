"""The compact tensor table of formats 4.x and 5.x (docs/format.md section 4.4): the table as columns.

Scope: encoding a manifest's tensor table as columns (names front-coded, dtypes and shapes as indices into
small tables, offsets delta-coded in 4096-byte units, every CRC-32C in one hex string) and decoding it with
every check of the per-entry table (docs/format.md 4.2 steps 4-5), with every size a forged table could make
a reader allocate bounded before it is allocated.
Anti-scope: the runs of the tree (``treeruns.py``), the rest of the manifest (``manifest.py``: versions,
shards, seal, ranges, the tree's grammar), I/O.

Why: in JSON per entry a tensor costs ~280 bytes (its entry with six keys, and its tree leaf repeating its
name), so the 64 MiB cap held ~240,000 tensors, and ``json.loads`` built ~10 Python objects per tensor.
Columns cost ~40 bytes per tensor and a handful of large lists, whose checks run in C (``map``, ``min``,
``max``, list equality, one regex scan). A decoding failure is found column-wise, then located entry by
entry so the error names the tensor, as the per-entry checks do.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from itertools import accumulate, chain, repeat
from typing import Any, Protocol

from ..errors import FormatError
from .columns import HEX, ITEMSIZE, Columns, Fail, chunk_counts, ints

COMPACT_MIN_TENSORS = 10_000
"""A manifest with at least this many tensors is written in the compact encoding (format 4.x); smaller ones
keep the per-entry table, which every 1.x-3.x reader reads (below it the JSON is under ~3 MiB and parses in
~0.1 s, so compatibility is worth more than the bytes)."""
TABLE_FIELDS = ("names", "dtypes", "dtype", "shapes", "shape", "shard", "offset", "crc32c")
MAX_TENSORS = 1 << 22
"""The most tensors one table may hold (4,194,304). A non-empty tensor takes at least ~23 bytes of a compact
manifest (its CRC alone 8), so the 64 MiB cap holds under 3 million of them (~2.1 million of an MoE state's
in format 5.0). Checked first, from the length of one column, so a forged table is refused before a
per-tensor list is built from it."""
MAX_NAME_BYTES = 256 << 20
"""The decoded names of one table take at most this many bytes of characters (4x the manifest cap; a
non-ASCII name is counted at 4 bytes per character, the widest a Python string stores): front coding lets a
few bytes stand for a 1024-character name, and a forged table must not make a parse allocate gigabytes. A
per-entry table is bounded by the cap itself."""
_ALIGN = 4096


class Entry(Protocol):
    """What the encoders read of a tensor entry (``manifest.TensorEntry``)."""

    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def shard(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def crc32c(self) -> tuple[str, ...]: ...


def entry_table(names: Sequence[str], entries: Sequence[Entry]) -> dict[str, Any]:
    """The ``tensors`` object of a 1.x-3.x manifest: one object per tensor (docs/format.md section 4)."""
    return {
        name: {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "shard": t.shard,
            "offset": t.offset,
            "nbytes": t.nbytes,
            "crc32c": list(t.crc32c),
        }
        for name, t in zip(names, entries, strict=True)
    }


def _shared(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``: a binary search of slice comparisons (in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi], hi > lo
        mid = (lo + hi + 1) // 2
        if mid == hi:
            break
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def encode_table(names: Sequence[str], entries: Sequence[Entry]) -> dict[str, Any]:
    """The ``table`` object of a 4.x manifest for these tensors, in their order.

    Raises:
        FormatError: more tensors, or longer names in all, than a reader accepts (``MAX_TENSORS``,
            ``MAX_NAME_BYTES``), or an offset the table cannot hold.
    """
    if len(names) > MAX_TENSORS:
        raise FormatError(f"{len(names)} tensors: a manifest holds at most {MAX_TENSORS}")
    chars = sum(map(len, names))
    if (chars if all(map(str.isascii, names)) else 4 * chars) > MAX_NAME_BYTES:  # as _name_bytes, no join
        raise FormatError(f"the tensor names take over {MAX_NAME_BYTES} bytes, more than a manifest holds")
    shared = list(map(_shared, ["", *names[:-1]], names))
    dtype_of: dict[str, int] = {}
    shape_of: dict[tuple[int, ...], int] = {}
    dtype = [dtype_of.setdefault(e.dtype, len(dtype_of)) for e in entries]
    shape = [shape_of.setdefault(e.shape, len(shape_of)) for e in entries]
    units = [e.offset // _ALIGN for e in entries]
    if any(e.offset % _ALIGN for e in entries):  # the table stores 4 KiB units: refuse, never round
        bad = next(n for n, e in zip(names, entries) if e.offset % _ALIGN)
        raise FormatError(f"tensor {bad!r}: offset is not a multiple of {_ALIGN}, which a 4.x table cannot hold")
    return {
        "names": [shared, list(map(operator.getitem, names, map(slice, shared, repeat(None))))],
        "dtypes": list(dtype_of),
        "dtype": dtype,
        "shapes": [list(s) for s in shape_of],
        "shape": shape,
        "shard": [e.shard for e in entries],
        "offset": list(map(operator.sub, units, [0, *units[:-1]])),
        "crc32c": "".join(chain.from_iterable(e.crc32c for e in entries)),
    }


def _name_bytes(chars: int, joined: str) -> int:
    """Bytes of ``chars`` characters made of those of ``joined``: 1 each when it is ASCII (``isascii`` is O(1)
    on a string), else 4, the widest."""
    return chars if joined.isascii() else 4 * chars


def _front_decode(shared: list[int], suffixes: list[str]) -> list[str]:
    """Name i = name i-1's first ``shared[i]`` characters + ``suffixes[i]``."""
    names: list[str] = []
    add = names.append  # a plain loop: a fifth faster than ``accumulate`` with a lambda per name
    prev = ""
    for k, suffix in zip(shared, suffixes):
        prev = prev[:k] + suffix
        add(prev)
    return names


class TableDecoder:
    """Decodes and checks a ``table`` object; ``fail`` makes the error (it names the manifest)."""

    def __init__(self, fail: Fail, *, max_ndim: int, max_name: int, max_int: int) -> None:
        self.fail = fail
        self.max_ndim = max_ndim
        self.max_name = max_name
        self.max_int = max_int
        self.names: list[str] = []

    def first_bad(self, ok: Sequence[bool], what: str) -> FormatError:
        """The error for the first False of ``ok``, naming its tensor."""
        i = list(ok).index(False)
        name = repr(self.names[i]) if i < len(self.names) else f"#{i}"
        return self.fail(f"tensor {name} {what}")

    def decode(self, raw: Any, nshards: int, chunk_bytes: int, *, strict: bool = True) -> Columns:
        """The table's columns, checked. ``strict``: a field this reader does not know is an error (a table of
        this reader's minor version or an older one); else it is ignored (docs/format.md 4.2 step 3)."""
        if type(raw) is not dict:
            raise self.fail(f"table must be an object with the fields {', '.join(TABLE_FIELDS)}")
        missing = [k for k in TABLE_FIELDS if k not in raw]
        if missing:
            raise self.fail(f"table lacks field(s) {', '.join(missing)}")
        unknown = sorted(set(raw) - set(TABLE_FIELDS))
        if unknown and strict:
            raise self.fail(f"table has unknown field(s) {', '.join(k[:80] for k in unknown[:5])}")
        names = self.decode_names(raw["names"])
        n = len(names)
        for key in ("dtype", "shape", "shard", "offset"):
            if type(raw[key]) is not list or len(raw[key]) != n:
                raise self.fail(f"table.{key} must be an array of {n} integers, one per tensor")
        dtype_names = raw["dtypes"]
        if type(dtype_names) is not list:
            raise self.fail("table.dtypes must be an array of dtype names")
        for d in dtype_names:
            if type(d) is not str or d not in ITEMSIZE:
                raise self.fail(f"table.dtypes has unknown dtype {d if type(d) is str else type(d).__name__!r:.80}")
        shape_table = self.decode_shapes(raw["shapes"])
        dtype_idx = self.index_column(raw["dtype"], len(dtype_names), "dtype", "table.dtypes")
        shape_idx = self.index_column(raw["shape"], len(shape_table), "shape", "table.shapes")
        if n and nshards == 0:
            raise self.fail(f"tensor {names[0]!r} refers to shard 0 but there are no shards")
        shards = self.index_column(raw["shard"], nshards, "shard", "shards")
        offsets = self.decode_offsets(raw["offset"])
        elements = list(map(math.prod, shape_table))
        sizes = list(map(ITEMSIZE.__getitem__, dtype_names))
        nbytes = list(map(operator.mul, map(elements.__getitem__, shape_idx), map(sizes.__getitem__, dtype_idx)))
        if nbytes and max(nbytes) > self.max_int:
            raise self.first_bad([b <= self.max_int for b in nbytes], f"nbytes is over {self.max_int}")
        dtypes = list(map(dtype_names.__getitem__, dtype_idx))
        shapes = list(map(shape_table.__getitem__, shape_idx))
        return names, dtypes, shapes, shards, offsets, nbytes, self.decode_crcs(raw["crc32c"], nbytes, chunk_bytes)

    @staticmethod
    def label(shared: list[int], suffixes: list[str], lengths: list[int], i: int) -> str:
        """Name ``i`` (its first 80 characters, repr), decoded when the names up to it are within bounds."""
        if 4 * sum(lengths[: i + 1]) > MAX_NAME_BYTES:
            return f"#{i}"
        return repr(_front_decode(shared[: i + 1], suffixes[: i + 1])[i][:80])

    def decode_names(self, raw: Any) -> list[str]:
        """Front-coded names: ``[shared, suffixes]``, name i = name i-1's first ``shared[i]`` characters +
        ``suffixes[i]``; non-empty, at most ``max_name`` characters, no NUL, unique."""
        if type(raw) is not list or len(raw) != 2 or type(raw[1]) is not list:
            raise self.fail("table.names must be [shared prefix lengths, suffixes]")
        shared, suffixes = raw
        if len(suffixes) > MAX_TENSORS:  # before any list of one value per tensor is built
            raise self.fail(f"table.names has {len(suffixes)} names, over the limit of {MAX_TENSORS} tensors")
        if not ints(shared, 0, self.max_name) or len(shared) != len(suffixes) or (shared and shared[0] != 0):
            raise self.fail("table.names shared prefix lengths must be one integer per name, the first 0")
        if suffixes and set(map(type, suffixes)) != {str}:
            raise self.fail("table.names suffixes must be strings")
        # Lengths first, from the columns: a few bytes of front coding can stand for a name of max_name
        # characters, so the decoded size is bounded before any name is built (a faulty one is named only
        # when the names up to it fit in that bound).
        lengths = list(map(operator.add, shared, map(len, suffixes)))
        fits = list(map(operator.le, shared[1:], lengths))
        if not all(fits):
            i = fits.index(False) + 1
            what = "shares more characters with the name before it than that name has"
            raise self.fail(f"tensor {self.label(shared, suffixes, lengths, i)} {what}")
        if lengths and (min(lengths) < 1 or max(lengths) > self.max_name):
            i = [0 < k <= self.max_name for k in lengths].index(False)
            raise self.fail(
                f"tensor name {self.label(shared, suffixes, lengths, i)} is empty, too long or contains NUL"
            )
        joined = "".join(suffixes)  # every character of every name is one of a suffix
        total = _name_bytes(sum(lengths), joined)
        if total > MAX_NAME_BYTES:
            raise self.fail(f"table.names decode to {total} bytes of characters, over the {MAX_NAME_BYTES} limit")
        names = self.names = _front_decode(shared, suffixes)
        if "\0" in joined:
            bad = next(s for s in names if "\0" in s)
            raise self.fail(f"tensor name {bad[:80]!r} is empty, too long or contains NUL")
        if len(set(names)) != len(names):
            seen: set[str] = set()
            for name in names:
                if name in seen:
                    raise self.fail(f"tensor name {name[:80]!r} appears twice in the table")
                seen.add(name)
        return names

    def decode_shapes(self, raw: Any) -> list[tuple[int, ...]]:
        if type(raw) is not list or (raw and set(map(type, raw)) != {list}):
            raise self.fail("table.shapes must be an array of shapes (arrays of integers)")
        if raw and max(map(len, raw)) > self.max_ndim:
            raise self.fail(f"table.shapes has a shape of more than {self.max_ndim} dimensions")
        if not ints(list(chain.from_iterable(raw)), 0, self.max_int):
            raise self.fail(f"table.shapes dimensions must be integers in [0, {self.max_int}]")
        return list(map(tuple, raw))

    def index_column(self, raw: list[Any], size: int, what: str, table: str) -> list[int]:
        if not ints(raw, 0, size - 1):
            ok = [type(v) is int and 0 <= v < size for v in raw]
            raise self.first_bad(ok, f"{what} index is not an integer in [0, {size - 1}] (an index into {table})")
        return raw

    def decode_offsets(self, raw: list[Any]) -> list[int]:
        """Offsets in 4096-byte units, each the difference to the offset before (the first to 0)."""
        if raw and set(map(type, raw)) != {int}:  # a bool is not an integer here
            raise self.first_bad([type(v) is int for v in raw], "offset delta is not an integer")
        units = list(accumulate(raw))
        hi = self.max_int // _ALIGN
        if units and (min(units) < 0 or max(units) > hi):
            raise self.first_bad([0 <= u <= hi for u in units], f"offset is out of range [0, {hi * _ALIGN}]")
        return list(map(operator.mul, units, repeat(_ALIGN)))

    def decode_crcs(self, raw: Any, nbytes: list[int], chunk_bytes: int) -> list[tuple[str, ...]]:
        """One string of 8 lowercase hex digits per chunk, tensor after tensor."""
        if not isinstance(raw, str) or not HEX.fullmatch(raw):
            raise self.fail("table.crc32c must be one string of lowercase hex digits")
        chunks = chunk_counts(nbytes, chunk_bytes)
        ends = list(accumulate(chunks))
        total = ends[-1] if ends else 0
        if len(raw) != 8 * total:
            raise self.fail(f"table.crc32c has {len(raw)} hex digits for {total} chunks (8 per chunk)")
        crcs = [raw[i : i + 8] for i in range(0, len(raw), 8)]
        if chunks.count(1) == len(chunks):  # one chunk each: the common case of many small tensors
            return list(zip(crcs, strict=True))
        return list(map(tuple, map(crcs.__getitem__, map(slice, [0, *ends[:-1]], ends))))
