"""Many ranks, one checkpoint: the global manifest of a collective save, and each rank's view of it.

Every rank of a ``torch.distributed`` job saves its own state (its shards, its optimizer state, its data
position and RNG) into one checkpoint per step. Each rank writes its own shard files
(``shard-RRRRR-SSS.bin``) under one attempt prefix all ranks agree on without a collective; then each rank
votes with what it wrote (:func:`rank_part`), and rank 0 merges the parts into one manifest
(:func:`merge_parts`) and commits it only if every rank voted yes (``CoordinationGroup.vote``: one gather and
one broadcast per save, whatever the number of tensors).

The global manifest is a plain manifest (format 1.x; 2.x when an incremental save's ranks reference their
own shards of an earlier step): ``world_size`` is the number of ranks, every shard
records its ``rank``, every tensor is named ``rank-RRRRR/<name>`` and the tree is
``{"rank-00000": <rank 0's tree>, "rank-00001": ...}``. Tensors declared replicated (replicated.py) are
written once in total, by the rank each is assigned to, and named ``replicated/<name>``: every rank's tree
refers to that one copy. A reader that knows nothing of ranks still reads (and verifies, exports) everything;
a rank restores only its own subtree and reads its own tensors and the replicated ones (:func:`rank_view`).

Scope: the layout of a collective checkpoint's manifest, the attempt token, and checking that the ranks'
shards are where rank 0 commits. Anti-scope: the coordination protocol (dist/), writing shards (engine/),
the commit protocol (commit.py).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import operator
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from itertools import accumulate, chain, compress, repeat
from typing import TYPE_CHECKING, Any

from .commit import tmp_token
from .errors import (
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    StateMismatchError,
)
from .format import layout as _layout
from .format.columns import ranges_ok
from .format.dtypes import DTYPES
from .format.jsonsafe import paused_gc
from .format.layout import ALIGN
from .format.manifest import Manifest, ShardInfo, TensorEntry, entries_from_columns
from .format.tree import T_NDARRAY, T_TENSOR, escape_key
from .format.view import RankPart
from .replicated import REPLICATED_PREFIX, Selection, check_agreement

if TYPE_CHECKING:  # pragma: no cover
    from .dist import CoordinationGroup

__all__ = [
    "Collective",
    "encode_global",
    "global_manifest",
    "join",
    "merge_parts",
    "rank_key",
    "rank_part",
    "rank_view",
    "shared_shards",
    "table_columns",
    "table_entries",
    "view_part",
]

_ITEMSIZE = {name: d.itemsize for name, d in DTYPES.items()}
_MAX_INT = (1 << 63) - 1
_HEX = re.compile("[0-9a-f]*")


class Collective:
    """A Checkpointer's place in a ``torch.distributed`` job: its coordination group and the attempt tokens.

    Every rank names a save's attempt prefix from rank 0's token base and a counter that advances with each
    save, so all ranks write under one prefix with no collective at save start (saves are collective: every
    rank makes the same saves in the same order). The token keeps rank 0's pid and host, so a crashed
    attempt's leftovers are recognised as dead by rank 0's host, as for a single process.
    """

    def __init__(self, group: CoordinationGroup, token_base: str) -> None:
        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size
        owner, sep, self._secret = token_base.rpartition("-")
        if not sep or not owner:
            raise ConfigError(f"rank 0 sent a malformed attempt token base {token_base!r}")
        self._owner = owner
        self._counter = itertools.count(1)

    def next_token(self) -> str:
        """``<rank 0's pid>-<rank 0's host>-<16 hex>``: the form of a single process's token (leftover
        detection and object-store attempt names rely on it), different for every save."""
        digest = hashlib.sha256(f"{self._secret}/{next(self._counter)}".encode()).hexdigest()[:16]
        return f"{self._owner}-{digest}"

    def derived_token(self, label: str) -> str:
        """A token of the same form that every rank derives alike from ``label`` (e.g. a drain's tier and step),
        with no exchange and without advancing the saves' counter."""
        digest = hashlib.sha256(f"{self._secret}/{label}".encode()).hexdigest()[:16]
        return f"{self._owner}-{digest}"


def join(process_group: Any, timeout_s: float) -> Collective | None:
    """The Checkpointer's :class:`Collective` when ``torch.distributed`` is initialized with more than one rank
    (or ``process_group`` is given); None for a single process. Collective: every rank calls it, in order.

    Raises:
        ConfigError: ``process_group`` given but torch.distributed is not initialized.
    """
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    if process_group is not None and not initialized:
        raise ConfigError("process_group was given but torch.distributed is not initialized")
    if not initialized or (process_group is None and dist.get_world_size() == 1):
        return None
    from .dist import CoordinationGroup

    group = CoordinationGroup(timeout_s=timeout_s, process_group=process_group)
    base = group.broadcast_json(tmp_token() if group.is_coordinator else None)
    if not isinstance(base, str):
        raise ConfigError(f"rank 0 sent no attempt token base (got {base!r})")
    return Collective(group, base)


def rank_key(rank: int) -> str:
    """``rank-00003``: the rank's key in the global tree and the prefix of its tensor names."""
    return f"rank-{rank:05d}"


@paused_gc()  # tens of thousands of small acyclic objects: no collection rescanning them as they are made
def rank_part(
    rank: int,
    shards: Sequence[ShardInfo],
    tensors: Mapping[str, TensorEntry],
    tree: Any,
    replicated: Selection | None = None,
    content_hash: str = "sha256",
    prints: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What a rank votes with: its shards, its tensors as columns (:func:`table_columns`, shard indices local
    to its shards) and its tree, whose references already carry their names in the global manifest (this
    rank's ``rank-RRRRR/``, or ``replicated/`` under a declared key); with ``replicated``, the replicated
    tensors it wrote apart from its own, and the digest of the replicated layout that rank 0 compares across
    ranks (and, at an async save that checks the declaration, the fingerprints of the replicated state,
    replicated.fingerprints); with content hashes (an incremental save), their function.

    The rank does this work, not rank 0: the ranks build their parts in parallel, and rank 0 only checks the
    columns (in C, whatever their length) and concatenates them.

    Raises:
        ConfigError: replicated keys were declared but the tree is not a dict (the rank votes no with it).
    """
    shared = replicated.names if replicated is not None else frozenset()
    prefix = rank_key(rank) + "/"
    own = [t for t in tensors.values() if t.name not in shared] if shared else list(tensors.values())
    if replicated is None:
        tree = _prefix_refs(tree, prefix)
    elif not isinstance(tree, dict):
        raise ConfigError(f"rank {rank} declared replicated keys but its state is not a dict")
    else:
        keys = {escape_key(k) for k in replicated.keys}
        tree = {k: _prefix_refs(v, REPLICATED_PREFIX if k in keys else prefix) for k, v in tree.items()}
    part: dict[str, Any] = {
        "rank": rank,
        "shards": [_shard_part(s) for s in shards],
        "table": table_columns(own),
        "tree": tree,
    }
    if any(s.content for s in shards):
        part["content_hash"] = content_hash
    if replicated is not None:
        part["replicated"] = {
            "keys": [escape_key(k) for k in replicated.keys],
            "digest": replicated.digest,
            "count": len(replicated.tensors),
            "table": table_columns([t for t in tensors.values() if t.name in shared]),
        }
        if prints is not None:
            part["replicated"]["prints"] = dict(prints)
    return part


def table_columns(entries: Sequence[TensorEntry]) -> dict[str, Any]:
    """Tensor entries as the columns a rank sends: names, dtype and shape as indices into small tables,
    shard (local), offset, nbytes, and every chunk's CRC-32C in one hex string (JSON of a few long lists:
    about a third of the bytes of one object per tensor, and decoded far faster on rank 0)."""
    dtype_of: dict[str, int] = {}
    shape_of: dict[tuple[int, ...], int] = {}
    return {
        "names": [t.name for t in entries],
        "dtype": [dtype_of.setdefault(t.dtype, len(dtype_of)) for t in entries],
        "shape": [shape_of.setdefault(t.shape, len(shape_of)) for t in entries],
        "dtypes": list(dtype_of),
        "shapes": [list(s) for s in shape_of],
        "shard": [t.shard for t in entries],
        "offset": [t.offset for t in entries],
        "nbytes": [t.nbytes for t in entries],
        "crc32c": "".join(chain.from_iterable(t.crc32c for t in entries)),
    }


def _shard_part(s: ShardInfo) -> dict[str, Any]:
    """A shard in a rank's part; an incremental save's also with its content hashes and referenced step."""
    out: dict[str, Any] = {"file": s.file, "size": s.size}
    if s.content:
        out["content"] = [[n, h] for n, h in s.content]
    if s.step is not None:
        out["step"] = s.step
    return out


def _shard_of(step: int, rank: int, raw: Any) -> ShardInfo:
    """A shard of rank ``rank``'s part, its types checked."""
    ok = isinstance(raw, dict) and isinstance(raw.get("file"), str) and _layout.is_safe_file(raw["file"])
    ok = ok and _int(raw.get("size"))
    ok = ok and raw["size"] % ALIGN == 0
    content: Any = raw.get("content", []) if ok else None
    ref = raw.get("step") if ok else None
    pairs = isinstance(content, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], str) for p in content
    )
    if not ok or not pairs or not (ref is None or _int(ref)):
        raise ConfigError(f"step {step}: rank {rank} sent a malformed shard entry {str(raw)[:200]}")
    return ShardInfo(raw["file"], rank, raw["size"], tuple((n, h) for n, h in content), ref)


def _int(value: Any) -> bool:
    return type(value) is int and value >= 0


@paused_gc()  # an entry per tensor of every rank
def merge_parts(
    step: int,
    parts: Sequence[Any],
    *,
    chunk_bytes: int,
    metrics: Mapping[str, float],
    tags: tuple[str, ...],
    metadata: Mapping[str, Any],
    stats: Mapping[str, Any],
) -> Manifest:
    """Rank 0: the global manifest of every rank's part (``parts[r]`` from rank ``r``).

    Each rank's part is what a single process would commit for its own state (its pipeline's entries, its
    flattened tree), so rank 0 checks only what crosses the wire and what no rank can check alone: each
    part's columns (types, ranges, nbytes against shape and dtype, one checksum per chunk, every tensor
    inside its shard and none overlapping; column by column, in C), that the ranks declared the same
    replicated layout and wrote each replicated tensor once. It does not walk the trees or re-validate entry
    by entry: at 8 ranks x 50,000 tensors that was most of the commit (docs/distributed.md).

    Raises:
        ConfigError: a part does not come from the rank at its position, is malformed, or the ranks disagree
            on the replicated state.
    """
    shards: list[ShardInfo] = []
    columns: dict[str, list[Any]] = {f: [] for f in _ENTRY_FIELDS}  # by TensorEntry field, never by position
    tree: dict[str, Any] = {}
    layout = _replicated_layout(step, parts)
    replicated_count = 0
    for rank, part in enumerate(parts):
        base = len(shards)
        raw_shards = part.get("shards")
        if not isinstance(raw_shards, list):
            raise ConfigError(f"step {step}: rank {rank} sent no shard list")
        mine = [_shard_of(step, rank, s) for s in raw_shards]
        shards.extend(mine)
        tables = [(part.get("table"), rank_key(rank) + "/")]
        if layout is not None:
            tables.append((part["replicated"].get("table"), REPLICATED_PREFIX))
        got = [table_entries(step, rank, raw, prefix, base, len(mine), chunk_bytes) for raw, prefix in tables]
        if layout is not None:
            replicated_count += len(got[1]["name"])
        rank_cols = {f: list(chain.from_iterable(g[f] for g in got)) for f in _ENTRY_FIELDS}
        sizes = [s.size for s in mine]
        local = [shard - base for shard in rank_cols["shard"]]
        if not ranges_ok(sizes, local, rank_cols["offset"], rank_cols["nbytes"], ALIGN):
            raise ConfigError(
                f"step {step}: rank {rank} sent tensors outside their shards, overlapping or not {ALIGN}-aligned"
            )
        for f, values in rank_cols.items():
            columns[f].extend(values)
        tree[rank_key(rank)] = part.get("tree")
    if len({(s.file, s.step) for s in shards}) != len(shards):
        raise ConfigError(f"step {step}: two ranks sent the same shard file")
    # The manifest parser's fast constructor: the columns were checked above, as the parser checks its own.
    ordered = tuple(columns[f] for f in _ENTRY_FIELDS)
    tensors = dict(zip(columns["name"], entries_from_columns(ordered), strict=True))  # type: ignore[arg-type]
    if len(tensors) != len(columns["name"]):
        raise ConfigError(f"step {step}: {_duplicate(columns['name'])!r} was written by more than one rank")
    if layout is not None and replicated_count != layout["count"]:
        raise ConfigError(
            f"step {step}: the ranks wrote {replicated_count} of the {layout['count']} replicated tensors: they "
            "did not assign them alike"
        )
    hashes = {part.get("content_hash", "sha256") for part in parts if any("content" in s for s in part["shards"])}
    if len(hashes) > 1:
        raise ConfigError(
            f"step {step}: the ranks hashed their pieces with different functions ({', '.join(sorted(hashes))}): "
            "install the same blake3 package on every node, or set TIERSAVE_CONTENT_HASH alike on every rank"
        )
    return Manifest(
        step=step,
        shards=tuple(shards),
        tensors=tensors,
        tree=tree,
        content_hash=hashes.pop() if hashes else "sha256",
        world_size=len(parts),
        chunk_bytes=chunk_bytes,
        metrics=metrics,
        tags=tags,
        metadata=metadata,
        stats=stats,
    )


def global_manifest(step: int, parts: Sequence[Any], phases: dict[str, float], **fields: Any) -> tuple[Manifest, bytes]:
    """Rank 0: :func:`merge_parts` and :func:`encode_global`, their durations and the manifest's size put in
    ``phases`` (``merge_s``, ``encode_s``, ``manifest_bytes``: the save's statistics)."""
    start = time.perf_counter()
    manifest = merge_parts(step, parts, **fields)
    merged = time.perf_counter()
    data = encode_global(manifest)
    phases.update(merge_s=merged - start, encode_s=time.perf_counter() - merged, manifest_bytes=len(data))
    return manifest, data


def encode_global(manifest: Manifest) -> bytes:
    """Rank 0: the global manifest's bytes (``Manifest.to_json``), before anything is committed.

    Raises:
        FormatError: the merged manifest would exceed the manifest cap: naming the ranks, the tensors and the
            cap (every rank raises it, through the vote, and nothing becomes visible).
    """
    try:
        return manifest.to_json()
    except FormatError as exc:
        cap = _layout.MAX_MANIFEST_BYTES  # read at the call: a test lowers it
        if "-byte limit" not in str(exc):
            raise
        raise FormatError(
            f"step {manifest.step}: the global manifest of {manifest.world_size} ranks and {len(manifest.tensors)} "
            f"tensors would exceed the {cap}-byte cap of a manifest ({exc}); nothing was "
            "committed. Save fewer, larger tensors per rank (group small ones), or fewer ranks per checkpoint; "
            "docs/distributed.md (Scale) gives the limits",
            path=f"step {manifest.step}",
        ) from exc


def _duplicate(names: list[str]) -> str:
    seen: set[str] = set()
    return next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]


def table_entries(
    step: int, rank: int, raw: Any, prefix: str, base: int, nshards: int, chunk_bytes: int
) -> dict[str, list[Any]]:
    """Rank 0: the columns of a rank's :func:`table_columns` by ``TensorEntry`` field name (names with
    ``prefix``, shard indices moved by ``base``), every value checked column by column.

    Raises:
        ConfigError: the table is malformed or has a column this version does not write (naming the rank
            and what is wrong).
    """

    def fail(what: str) -> ConfigError:
        return ConfigError(f"step {step}: rank {rank} sent a malformed tensor table: {what}")

    if type(raw) is not dict:
        raise fail("not an object")
    if unknown := raw.keys() - _TABLE_COLUMNS:  # parts carry no version: an unknown column may hold data
        raise fail(f"unknown column(s) {sorted(unknown)[:5]} (another tiersave version on that rank?)")
    fields: list[Any] = [raw.get(k) for k in ("names", "dtype", "shape", "dtypes", "shapes", "crc32c")]
    names, dtype, shape, dtypes, shapes, crc = fields
    cols: list[Any] = [raw.get(k) for k in ("shard", "offset", "nbytes")]
    shard, offset, nbytes = cols
    if type(names) is not list or (names and set(map(type, names)) != {str}):
        raise fail("names must be a list of strings")
    n = len(names)
    if any(type(c) is not list or len(c) != n for c in (dtype, shape, shard, offset, nbytes)):
        raise fail(f"every column must list {n} values")
    if type(dtypes) is not list or not set(dtypes) <= _ITEMSIZE.keys():
        raise fail(f"unknown dtype in {str(dtypes)[:200]}")
    if type(shapes) is not list or not all(type(s) is list and _ints(s, 0, _MAX_INT) for s in shapes):
        raise fail("shapes must be lists of non-negative ints")
    if not (_ints(dtype, 0, len(dtypes) - 1) and _ints(shape, 0, len(shapes) - 1)):
        raise fail("a dtype or shape index is out of range")
    if not (_ints(shard, 0, nshards - 1) and _ints(offset, 0, _MAX_INT) and _ints(nbytes, 0, _MAX_INT)):
        raise fail(f"a shard index is not below {nshards}, or an offset or size is not a non-negative int")
    sizes = {(d, s): math.prod(shapes[s]) * _ITEMSIZE[dtypes[d]] for d, s in set(zip(dtype, shape))}
    if list(map(sizes.__getitem__, zip(dtype, shape))) != nbytes:
        raise fail("a tensor's nbytes differs from its shape and dtype")
    chunks = [-(-size // chunk_bytes) for size in nbytes]
    if type(crc) is not str or len(crc) != 8 * sum(chunks) or not _HEX.fullmatch(crc):
        raise fail(f"crc32c must hold 8 hex digits for each of the {sum(chunks)} chunks")
    crcs = [crc[i : i + 8] for i in range(0, len(crc), 8)]
    if chunks.count(1) == n:  # one chunk each: the common case of many small tensors
        per_tensor: list[tuple[str, ...]] = list(zip(crcs, strict=True))
    else:
        ends = list(accumulate(chunks))
        per_tensor = [tuple(crcs[e - c : e]) for c, e in zip(chunks, ends, strict=True)]
    shape_tuples = [tuple(s) for s in shapes]
    return {
        "name": list(map(operator.add, repeat(prefix), names)),
        "dtype": list(map(dtypes.__getitem__, dtype)),
        "shape": list(map(shape_tuples.__getitem__, shape)),
        "shard": list(map(operator.add, repeat(base), shard)),
        "offset": offset,
        "nbytes": nbytes,
        "crc32c": per_tensor,
    }


_TABLE_COLUMNS = frozenset(("names", "dtype", "shape", "dtypes", "shapes", "shard", "offset", "nbytes", "crc32c"))
_ENTRY_FIELDS = tuple(f.name for f in dataclass_fields(TensorEntry))  # entries_from_columns's order


def _ints(values: list[Any], lo: int, hi: int) -> bool:
    """Every value is an int (not a bool) in [lo, hi]; True for an empty list."""
    return not values or (set(map(type, values)) == {int} and min(values) >= lo and max(values) <= hi)


def _replicated_layout(step: int, parts: Sequence[Any]) -> dict[str, Any] | None:
    """Rank 0: the replicated layout every rank declared (None when none did), after checking the parts come
    from their ranks and agree on it (same keys, same tensors by name, dtype and shape).

    Raises:
        ConfigError: a part is not its rank's, or the ranks disagree on what is replicated.
    """
    for rank, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("rank") != rank:
            raise ConfigError(f"step {step}: the part at position {rank} is not rank {rank}'s")
    layouts = [part.get("replicated") for part in parts]
    first: dict[str, Any] | None = layouts[0]

    def same(layout: Any) -> bool:
        if first is None or layout is None:
            return layout is first
        return all(layout.get(k) == first.get(k) for k in ("keys", "digest", "count"))

    differ = [r for r, layout in enumerate(layouts) if not same(layout)]
    if differ:
        raise ConfigError(
            f"step {step}: rank(s) {differ} declared other replicated state than rank 0 (other keys, or tensors "
            "with other names, dtypes or shapes): every rank must pass the same replicated= and hold that state "
            "identically"
        )
    if first is not None and not (isinstance(first.get("keys"), list) and isinstance(first.get("count"), int)):
        raise ConfigError(f"step {step}: rank 0 sent a malformed replicated layout")
    prints = [layout.get("prints") for layout in layouts if layout is not None]
    if first is not None and len(prints) == len(parts) and all(p is not None for p in prints):
        check_agreement(prints, step)  # the first async save declaring these keys: the fingerprints agree
    return first


def rank_view(manifest: Manifest, rank: int | None, world_size: int) -> Manifest:
    """The part of ``manifest`` that ``rank`` of a job of ``world_size`` ranks restores.

    A single-rank checkpoint is its own view for a single-process job. ``rank`` given explicitly (``restore(
    rank=R)`` in a single process) selects that rank's part of a collective checkpoint.

    Raises:
        StateMismatchError: the checkpoint was saved by another number of ranks (resharding goes through DCP).
    """
    saved = manifest.world_size
    if rank is None or world_size > 1:  # a job restores its own part: the number of ranks must match
        if saved != world_size:
            raise StateMismatchError(
                f"step {manifest.step} was saved by {saved} rank(s) and this job has {world_size}: the native "
                "API restores onto the same number of ranks only. Reshard through torch.distributed.checkpoint "
                "with tiersave.dcp (docs/dcp.md), or, in a single process, read one rank's state with "
                "restore(rank=R)"
            )
        if saved == 1:
            return manifest
    elif saved == 1 or not 0 <= rank < saved:  # restore(rank=R) in a single process
        raise StateMismatchError(
            f"step {manifest.step} was saved by {saved} rank(s): there is no rank {rank} to restore"
            + (" (a single-rank checkpoint: restore it without rank=)" if saved == 1 else "")
        )
    assert rank is not None
    key = rank_key(rank)
    prefix = key + "/"
    if manifest.part is None:  # the whole tree: the rank's own subtree (a tree that is no dict has none)
        tree = manifest.tree.get(key) if isinstance(manifest.tree, dict) else None
    else:  # a view: the rank's subtree already
        tree = manifest.tree
    if tree is None or manifest.part not in (None, rank):
        raise CorruptCheckpointError(
            f"step {manifest.step}: the manifest has no state for rank {rank}", step=manifest.step
        )
    # The replicated tensors in the same order on every rank (by writer): the ranks of one node read the same
    # file regions at about the same time, from the device once, through their page cache. Starting each rank
    # on another file (tried until 2026-11-24) read slower on a disk: more streams at once (docs/benchmarks.md).
    items, names = manifest.tensors.items(), manifest.tensors.keys()
    shared = list(compress(items, map(str.startswith, names, repeat(REPLICATED_PREFIX))))  # in C: 10^5 names
    tensors = dict(compress(items, map(str.startswith, names, repeat(prefix))))  # a view's too (view_part)
    shards = manifest.shards
    shared.sort(key=lambda item: shards[item[1].shard].rank)
    tensors.update(shared)
    return replace(manifest, tree=tree, tensors=tensors)


def view_part(rank: int | None, world_size: int) -> RankPart | None:
    """What ``rank`` of a job of ``world_size`` ranks parses of a checkpoint it restores (its view: its own
    tensors, the replicated ones and its subtree; format/view.py); None: the whole manifest."""
    if rank is None or world_size == 1:  # a single process: restore(rank=R) keeps the whole one's checks
        return None
    return RankPart(rank, rank_key(rank), rank_key(rank) + "/", REPLICATED_PREFIX)


def shared_shards(view: Manifest) -> frozenset[int]:
    """The shards of a rank's ``view`` (:func:`rank_view`) that hold replicated tensors: every rank of the job
    reads them, so the ranks sharing a machine read them buffered, through one page cache."""
    return frozenset(t.shard for name, t in view.tensors.items() if name.startswith(REPLICATED_PREFIX))


def _prefix_refs(tree: Any, prefix: str) -> Any:
    """A copy of an encoded tree whose tensor references (``$tensor``, ``$ndarray``) carry ``prefix``.

    Iterative: trees are deep-capped, but nothing here should depend on the recursion limit."""
    out: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(tree, out, 0)]
    while stack:
        node, parent, key = stack.pop()
        if isinstance(node, list):
            copy: Any = [None] * len(node)
            stack.extend((v, copy, i) for i, v in enumerate(node))
        elif isinstance(node, dict):
            if len(node) == 1:
                ((tag, payload),) = node.items()
                if tag in (T_TENSOR, T_NDARRAY) and isinstance(payload, str):
                    parent[key] = {tag: prefix + payload}
                    continue
            copy = {}
            for k, v in node.items():
                copy[k] = None
                stack.append((v, copy, k))
        else:
            copy = node
        parent[key] = copy
    return out[0]
