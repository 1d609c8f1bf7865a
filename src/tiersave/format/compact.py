"""The compact tensor table of format 4.x (docs/format.md section 4.4): the table as columns, and runs of
tensors in the tree written once.

Scope: encoding a manifest's tensor table as columns (names front-coded, dtypes and shapes as indices into
small tables, offsets delta-coded in 4096-byte units, every CRC-32C in one hex string) and decoding it with
every check of the per-entry table (docs/format.md 4.2 steps 4-5); the ``$tensors`` runs of the tree (a dict
whose values are consecutive tensors named ``prefix + key``) and their expansion back into ``$tensor`` leaves.
Anti-scope: the rest of the manifest (``manifest.py``: versions, shards, seal, ranges, the tree's grammar,
which sees the expanded tree), I/O.

Why: in JSON per entry a tensor costs ~280 bytes (its entry with six keys, and its tree leaf repeating its
name), so the 64 MiB cap held ~240,000 tensors, and ``json.loads`` built ~10 Python objects per tensor.
Columns cost ~40 bytes per tensor and a handful of large lists, whose checks run in C (``map``, ``min``,
``max``, list equality, one regex scan). A decoding failure is found column-wise, then located entry by
entry so the error names the tensor, as the per-entry checks do.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Sequence
from itertools import accumulate, chain, compress, repeat
from typing import Any, Protocol

from ..errors import FormatError
from .columns import Columns
from .dtypes import DTYPES

COMPACT_MIN_TENSORS = 10_000
"""A manifest with at least this many tensors is written in the compact encoding (format 4.x); smaller ones
keep the per-entry table, which every 1.x-3.x reader reads (below it the JSON is under ~3 MiB and parses in
~0.1 s, so compatibility is worth more than the bytes)."""
T_RUN = "$tensors"
TABLE_FIELDS = ("names", "dtypes", "dtype", "shapes", "shape", "shard", "offset", "crc32c")
MAX_NAME_CHARS = 256 << 20
"""The decoded names of one table hold at most this many characters in all (4x the manifest cap): front
coding lets a few bytes stand for a 1024-character name, and a forged table must not make a parse allocate
gigabytes. A per-entry table is bounded by the cap itself."""
_ALIGN = 4096
_HEX = re.compile("[0-9a-f]*")
_INT = {int}
_ITEMSIZE = {name: d.itemsize for name, d in DTYPES.items()}

Fail = Callable[[str], FormatError]


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
    """The ``table`` object of a 4.x manifest for these tensors, in their order."""
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


def _front_decode(shared: list[int], suffixes: list[str]) -> list[str]:
    """Name i = name i-1's first ``shared[i]`` characters + ``suffixes[i]``."""
    return list(accumulate(zip(shared, suffixes), lambda prev, cur: prev[: cur[0]] + cur[1], initial=""))[1:]


def _ints(values: Any, lo: int, hi: int) -> bool:
    """``values`` is a list of ints (not bools) in [lo, hi]; True for an empty list."""
    if type(values) is not list:
        return False
    return not values or (set(map(type, values)) == _INT and min(values) >= lo and max(values) <= hi)


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

    def decode(self, raw: Any, nshards: int, chunk_bytes: int) -> Columns:
        if type(raw) is not dict or set(raw) != set(TABLE_FIELDS):
            raise self.fail(f"table must be an object with exactly the fields {', '.join(TABLE_FIELDS)}")
        names = self.decode_names(raw["names"])
        n = len(names)
        for key in ("dtype", "shape", "shard", "offset"):
            if type(raw[key]) is not list or len(raw[key]) != n:
                raise self.fail(f"table.{key} must be an array of {n} integers, one per tensor")
        dtype_names = raw["dtypes"]
        if type(dtype_names) is not list:
            raise self.fail("table.dtypes must be an array of dtype names")
        for d in dtype_names:
            if type(d) is not str or d not in _ITEMSIZE:
                raise self.fail(f"table.dtypes has unknown dtype {d if type(d) is str else type(d).__name__!r:.80}")
        shape_table = self.decode_shapes(raw["shapes"])
        dtype_idx = self.index_column(raw["dtype"], len(dtype_names), "dtype", "table.dtypes")
        shape_idx = self.index_column(raw["shape"], len(shape_table), "shape", "table.shapes")
        if n and nshards == 0:
            raise self.fail(f"tensor {names[0]!r} refers to shard 0 but there are no shards")
        shards = self.index_column(raw["shard"], nshards, "shard", "shards")
        offsets = self.decode_offsets(raw["offset"])
        elements = list(map(math.prod, shape_table))
        sizes = list(map(_ITEMSIZE.__getitem__, dtype_names))
        nbytes = list(map(operator.mul, map(elements.__getitem__, shape_idx), map(sizes.__getitem__, dtype_idx)))
        if nbytes and max(nbytes) > self.max_int:
            raise self.first_bad([b <= self.max_int for b in nbytes], f"nbytes is over {self.max_int}")
        dtypes = list(map(dtype_names.__getitem__, dtype_idx))
        shapes = list(map(shape_table.__getitem__, shape_idx))
        return names, dtypes, shapes, shards, offsets, nbytes, self.decode_crcs(raw["crc32c"], nbytes, chunk_bytes)

    @staticmethod
    def label(shared: list[int], suffixes: list[str], lengths: list[int], i: int) -> str:
        """Name ``i`` (its first 80 characters, repr), decoded when the names up to it are within bounds."""
        if sum(lengths[:i]) > MAX_NAME_CHARS:
            return f"#{i}"
        return repr(_front_decode(shared[: i + 1], suffixes[: i + 1])[i][:80])

    def decode_names(self, raw: Any) -> list[str]:
        """Front-coded names: ``[shared, suffixes]``, name i = name i-1's first ``shared[i]`` characters +
        ``suffixes[i]``; non-empty, at most ``max_name`` characters, no NUL, unique."""
        if type(raw) is not list or len(raw) != 2 or type(raw[1]) is not list:
            raise self.fail("table.names must be [shared prefix lengths, suffixes]")
        shared, suffixes = raw
        if not _ints(shared, 0, self.max_name) or len(shared) != len(suffixes) or (shared and shared[0] != 0):
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
        if sum(lengths) > MAX_NAME_CHARS:
            raise self.fail(f"table.names decode to {sum(lengths)} characters, over the {MAX_NAME_CHARS} limit")
        names = self.names = _front_decode(shared, suffixes)
        if any(map(operator.contains, names, repeat("\0"))):
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
        if not _ints(list(chain.from_iterable(raw)), 0, self.max_int):
            raise self.fail(f"table.shapes dimensions must be integers in [0, {self.max_int}]")
        return list(map(tuple, raw))

    def index_column(self, raw: list[Any], size: int, what: str, table: str) -> list[int]:
        if not _ints(raw, 0, size - 1):
            ok = [type(v) is int and 0 <= v < size for v in raw]
            raise self.first_bad(ok, f"{what} index is not an integer in [0, {size - 1}] (an index into {table})")
        return raw

    def decode_offsets(self, raw: list[Any]) -> list[int]:
        """Offsets in 4096-byte units, each the difference to the offset before (the first to 0)."""
        if raw and set(map(type, raw)) != _INT:
            raise self.first_bad([type(v) is int for v in raw], "offset delta is not an integer")
        units = list(accumulate(raw))
        hi = self.max_int // _ALIGN
        if units and (min(units) < 0 or max(units) > hi):
            raise self.first_bad([0 <= u <= hi for u in units], f"offset is out of range [0, {hi * _ALIGN}]")
        return list(map(operator.mul, units, repeat(_ALIGN)))

    def decode_crcs(self, raw: Any, nbytes: list[int], chunk_bytes: int) -> list[tuple[str, ...]]:
        """One string of 8 lowercase hex digits per chunk, tensor after tensor."""
        if not isinstance(raw, str) or not _HEX.fullmatch(raw):
            raise self.fail("table.crc32c must be one string of lowercase hex digits")
        chunks = list(map(operator.neg, map(operator.floordiv, map(operator.neg, nbytes), repeat(chunk_bytes))))
        ends = list(accumulate(chunks))
        total = ends[-1] if ends else 0
        if len(raw) != 8 * total:
            raise self.fail(f"table.crc32c has {len(raw)} hex digits for {total} chunks (8 per chunk)")
        crcs = [raw[i : i + 8] for i in range(0, len(raw), 8)]
        if chunks.count(1) == len(chunks):  # one chunk each: the common case of many small tensors
            return list(zip(crcs, strict=True))
        return list(map(tuple, map(crcs.__getitem__, map(slice, [0, *ends[:-1]], ends))))


def compress_tree(tree: Any, names: Sequence[str]) -> Any:
    """``tree`` with each dict whose values are all ``{"$tensor": name}`` leaves of consecutive tensors of
    the table, each named ``prefix + key`` with one prefix, replaced by ``{"$tensors": [prefix, first,
    count]}``; each tensor in at most one run. :func:`expand_tree` is its exact inverse."""
    index = {name: i for i, name in enumerate(names)}
    used = bytearray(len(names))

    def run(node: dict[str, Any]) -> list[Any] | None:
        leaves = list(node.values())
        if not all(type(v) is dict and len(v) == 1 and type(v.get("$tensor")) is str for v in leaves):
            return None
        refs = [v["$tensor"] for v in leaves]
        first = index.get(refs[0], -1)
        if first < 0 or refs != names[first : first + len(refs)] or any(used[first : first + len(refs)]):
            return None
        keys = list(node)
        prefix = refs[0][: len(refs[0]) - len(keys[0])]
        if not refs[0].endswith(keys[0]) or list(map(operator.add, repeat(prefix), keys)) != refs:
            return None
        used[first : first + len(refs)] = b"\1" * len(refs)
        return [prefix, first, len(refs)]

    def walk(node: Any) -> Any:
        if type(node) is list:
            return [walk(v) for v in node]
        if type(node) is not dict:
            return node
        found = run(node) if node else None
        if found is not None:
            return {T_RUN: found}
        return {k: walk(v) for k, v in node.items()}

    return walk(tree)


class TreeRuns:
    """The ``$tensors`` runs of a parsed tree (docs/format.md 4.4), each checked to name tensors of the table,
    each tensor in at most one run, every name starting with the run's prefix.

    A run stands for ``{name[len(prefix):]: {"$tensor": name}}`` over its tensors. The tree's grammar is
    checked (``validate_tree``) on :meth:`standins`, where each run is the dict of its first two tensors
    only: a dict of two or more ``$tensor`` leaves is never a tag and each of its leaves is decoded the same
    way, so the grammar accepts the stand-in exactly when it accepts the whole run (a run of one is itself);
    the other names count as referenced (:meth:`referenced`). Then :meth:`expand` puts the whole dicts in.
    The tree is changed in place; containers are walked level by level (no recursion; the parser capped the
    depth)."""

    def __init__(self, tree: Any, names: list[str], fail: Fail) -> None:
        self.root = [tree]
        self.names = names
        self.sites: list[tuple[Any, Any]] = []
        raws: list[Any] = []
        level: list[tuple[Any, Any]] = [(self.root, 0)]
        while level:
            nxt: list[tuple[Any, Any]] = []
            for parent, key in level:
                node = parent[key]
                if type(node) is dict:
                    if len(node) == 1 and T_RUN in node:
                        self.sites.append((parent, key))
                        raws.append(node[T_RUN])
                        continue
                    nxt.extend(zip(repeat(node), node))
                elif type(node) is list:
                    nxt.extend(zip(repeat(node), range(len(node))))
            level = list(compress(nxt, (type(p[k]) in (dict, list) for p, k in nxt)))
        self.prefixes, self.firsts, self.counts = _check_runs(raws, names, fail)

    def _put(self, take: int | None) -> Any:
        """Each run as the dict of its first ``take`` tensors (all: None); runs of at most two tensors are put
        by the first call only, their stand-in being the whole run."""
        names = self.names
        for (parent, key), prefix, first, count in zip(
            self.sites, self.prefixes, self.firsts, self.counts, strict=True
        ):
            if take is not None or count > 2:
                cut = len(prefix)
                parent[key] = {s[cut:]: {"$tensor": s} for s in names[first : first + min(count, take or count)]}
        return self.root[0]

    def standins(self) -> Any:
        """The tree with each run as the dict of its first two tensors (at most)."""
        return self._put(2)

    def referenced(self) -> list[str]:
        """The names the runs reference beyond their stand-ins."""
        spans = map(slice, map(operator.add, self.firsts, repeat(2)), map(operator.add, self.firsts, self.counts))
        return list(chain.from_iterable(map(self.names.__getitem__, spans)))

    def expand(self) -> Any:
        """The tree with each run as the whole dict it stands for (after :meth:`standins`)."""
        return self._put(None)


def _check_runs(raws: list[Any], names: list[str], fail: Fail) -> tuple[list[str], list[int], list[int]]:
    """Each run's (prefix, first, count), checked run by run in C; on a fault, :func:`_check_run` in order
    finds and names the first faulty run."""
    n = len(names)
    ok = not raws or (set(map(type, raws)) == {list} and set(map(len, raws)) == {3})
    columns: list[list[Any]] = [list(c) for c in zip(*raws, strict=True)] if ok and raws else [[], [], []]
    prefixes, firsts, counts = columns
    ok = ok and (not raws or set(map(type, prefixes)) == {str}) and _ints(firsts, 0, n) and _ints(counts, 1, n)
    ends = list(map(operator.add, firsts, counts)) if ok else []
    ok = ok and (not ends or max(ends) <= n)
    if ok:  # no overlap: sorted by first, each run ends before the next begins
        order = sorted(range(len(firsts)), key=firsts.__getitem__)
        ok = all(map(operator.le, map(ends.__getitem__, order), map(firsts.__getitem__, order[1:])))
    if ok:
        spans = map(slice, firsts, ends)
        ok = all(
            map(
                str.startswith,
                chain.from_iterable(map(names.__getitem__, spans)),
                chain.from_iterable(map(repeat, prefixes, counts)),
            )
        )
    if not ok:
        used = bytearray(n)
        for raw in raws:
            _check_run(raw, names, used, fail)
        raise fail(f"tree {T_RUN} runs are malformed")  # unreachable while the two checks agree
    return prefixes, firsts, counts


def _check_run(raw: Any, names: list[str], used: bytearray, fail: Fail) -> tuple[str, int, int]:
    ok = type(raw) is list and len(raw) == 3 and type(raw[0]) is str and type(raw[1]) is type(raw[2]) is int
    if not ok or not (raw[1] >= 0 and raw[2] >= 1 and raw[1] + raw[2] <= len(names)):
        raise fail(f"tree {T_RUN} must be [prefix, first, count] naming some of the {len(names)} tensors")
    prefix, first, count = raw
    if any(used[first : first + count]):
        raise fail(f"tree {T_RUN} run of tensors {first}..{first + count - 1} overlaps another run")
    used[first : first + count] = b"\1" * count
    run = names[first : first + count]
    if not all(map(str.startswith, run, repeat(prefix))):
        bad = next(s for s in run if not s.startswith(prefix))
        raise fail(f"tree {T_RUN}: tensor {bad[:80]!r} does not start with the run's prefix {prefix[:80]!r}")
    return prefix, first, count
