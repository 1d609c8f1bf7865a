"""Incremental saves: which shards of a save equal shards of an earlier checkpoint (docs/format.md section 9).

Every write unit of a save (one checksum chunk of a large tensor, or a group of small tensors) is one *piece*
of its shard. On the writer threads, right where the CRC-32C is computed, :meth:`Increment.skip` hashes the
piece (BLAKE3 where the ``blake3`` package is installed, else SHA-256; both release the GIL over large
buffers, so the hashes run in parallel; BLAKE3 takes 2.3x less CPU per byte than SHA-256 even with the SHA
extensions, see docs/benchmarks.md) and, when the base checkpoint's shard at the same place holds the same
tensors and a piece with the same length and hash, the piece is not written. :meth:`Increment.settle` then
turns each shard whose every piece matched into a reference to the base's shard, and fills the few skipped
pieces of a shard that matched only in part from the base's copy (hash checked again on the bytes read), so
every shard is either referenced whole or written whole.

Most unchanged pieces are not hashed at all: the staging arena still holds the previous save's bytes, with
their digests recorded per unit (:meth:`Increment.record`). Where that record says the arena holds the
base's piece, staging compares the new bytes with it (``memcmp``, which reads about what a copy moves and is
exact) and copies only what differs; a writer thread then checks an unchanged piece's CRC-32C, which every
written piece gets anyway, against the base's, and references it with the base's digest. A record is
voided the moment a save begins staging, tied to the arena's memory, and replaced only by the last save to
stage, so it never describes bytes the arena no longer holds.

Scope: the hashes, the per-piece decision, the settling of shards and the manifest's shard entries of an
incremental save. Anti-scope: choosing the base checkpoint and keeping it from being deleted (the checkpoint
level: saving.py, catalog.py), validating references (format/manifest.py), the write path itself (pipeline.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from .. import knobs
from ..errors import ConfigError, CorruptCheckpointError
from ..format import CONTENT_HASHES
from ..format.layout import step_dirname
from ..format.manifest import Manifest, ShardInfo
from ..storage.base import BlobWriter, Storage

log = logging.getLogger(__name__)


class _ArenaRecord:
    """What one staging arena holds since the last save staged into it: per chunk unit, by its place in the
    arena, ``(length, padded, digest of the padded bytes there)``. ``generation`` counts the saves that
    began staging into it; a save records only while it is still the last one, so a record never outlives a
    later save's staging."""

    __slots__ = ("generation", "tensor", "units")

    def __init__(self) -> None:
        self.tensor: weakref.ref[object] | None = None
        self.generation = 0
        self.units: dict[int, tuple[int, int, str]] | None = None


# Keyed by the StagingArena object: its tensor is checked too, since a larger save reallocates it.
_records: weakref.WeakKeyDictionary[object, _ArenaRecord] = weakref.WeakKeyDictionary()
_records_lock = threading.Lock()


class Unit(Protocol):
    """What this module reads of ``pipeline.Unit`` (a protocol: the pipeline imports this module)."""

    @property
    def tensor(self) -> int: ...
    @property
    def chunk(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def global_offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def shard(self) -> int: ...
    @property
    def file_offset(self) -> int: ...
    @property
    def padded(self) -> int: ...


class ShardSpan(Protocol):
    @property
    def size(self) -> int: ...
    @property
    def first(self) -> int: ...
    @property
    def end(self) -> int: ...


class SavePlan(Protocol):
    """What this module reads of ``pipeline.SavePlan``."""

    @property
    def shards(self) -> Sequence[ShardSpan]: ...
    @property
    def units(self) -> Sequence[Unit]: ...
    @property
    def names(self) -> Sequence[str]: ...
    @property
    def dtypes(self) -> Sequence[str]: ...
    @property
    def shapes(self) -> Sequence[tuple[int, ...]]: ...
    @property
    def offsets(self) -> Sequence[int]: ...


_Signature = tuple[int, tuple[tuple[int, str, str, tuple[int, ...]], ...], tuple[int, ...]]


class _Hash(Protocol):
    def update(self, data: memoryview, /) -> object: ...
    def hexdigest(self) -> str: ...


@functools.cache  # a missing package would otherwise be searched for on every piece
def _blake3() -> Callable[[], _Hash] | None:
    try:
        import blake3
    except ImportError:
        return None
    new: Callable[[], _Hash] = blake3.blake3  # one thread per call: the writer threads are the parallelism
    return new


def content_hash() -> str:
    """The hash function this process gives new pieces (``TIERSAVE_CONTENT_HASH``; ``auto``: BLAKE3 where the
    ``blake3`` package is installed, else SHA-256).

    Raises:
        ConfigError: ``blake3`` is asked for and not installed.
    """
    choice = knobs.content_hash()
    if choice == "sha256":
        return "sha256"
    if _blake3() is not None:
        return "blake3"
    if choice == "blake3":
        raise ConfigError("TIERSAVE_CONTENT_HASH=blake3 needs the blake3 package: pip install blake3==1.0.11")
    return "sha256"


def hex_digest(algorithm: str, pieces: Sequence[memoryview]) -> str:
    """The ``algorithm`` digest (one of ``format.CONTENT_HASHES``, 32 bytes) of the concatenation of
    ``pieces``, as 64 lowercase hex digits."""
    new = hashlib.sha256 if algorithm == "sha256" else _blake3()
    if new is None or algorithm not in CONTENT_HASHES:
        raise ConfigError(f"content hash {algorithm!r} is not available here (blake3 needs the blake3 package)")
    h = new()
    for piece in pieces:
        h.update(piece)
    return h.hexdigest()


def _base_signatures(base: Manifest) -> dict[_Signature, int]:
    """Each base shard that has content hashes, by what it holds: size, tensors (offset, name, dtype, shape)
    and piece lengths."""
    members: dict[int, list[tuple[int, str, str, tuple[int, ...]]]] = {}
    for t in base.tensors.values():
        members.setdefault(t.shard, []).append((t.offset, t.name, t.dtype, t.shape))
    out: dict[_Signature, int] = {}
    for index, shard in enumerate(base.shards):
        if shard.content:
            tensors = tuple(sorted(members.get(index, ())))
            out[(shard.size, tensors, tuple(n for n, _ in shard.content))] = index
    return out


class Increment:
    """One incremental save's decisions, against ``base`` (None: a full save that still records hashes).

    Args:
        storage: the storage of the save and of the base checkpoint (the same root).
        plan: the save's layout.
        base: the manifest of the earlier checkpoint to reference, or None. A base whose pieces were hashed
            by another function than this process's (:func:`content_hash`) cannot be matched: the save is then
            a full one (``self.base`` is None), after which the chain goes on with this process's hash.
    """

    def __init__(self, storage: Storage, plan: SavePlan, base: Manifest | None) -> None:
        self.storage = storage
        self.plan = plan
        self.algorithm = content_hash()
        if base is not None and base.content_hash != self.algorithm and any(s.content for s in base.shards):
            log.info(
                "step %d hashed its pieces with %s, this process hashes with %s: the next save is a full one",
                base.step,
                base.content_hash,
                self.algorithm,
            )
            base = None
        self.base = base
        nshards = len(plan.shards)
        starts: list[list[tuple[int, int]]] = [[] for _ in range(nshards)]
        for u in plan.units:
            starts[u.shard].append((u.file_offset, u.padded))
        self._piece: dict[tuple[int, int], int] = {}
        self.lengths: list[list[int]] = []
        for s, pieces in enumerate(starts):
            pieces.sort()
            self.lengths.append([n for _, n in pieces])
            for k, (offset, _) in enumerate(pieces):
                self._piece[(s, offset)] = k
        self.digests: list[list[str]] = [[""] * len(n) for n in self.lengths]
        self.skipped: list[list[bool]] = [[False] * len(n) for n in self.lengths]
        self.matches: list[int | None] = [None] * nshards
        if base is not None:
            index = _base_signatures(base)
            for s, shard in enumerate(plan.shards):
                tensors = tuple(
                    sorted(
                        (plan.offsets[i], plan.names[i], plan.dtypes[i], plan.shapes[i])
                        for i in range(shard.first, shard.end)
                    )
                )
                self.matches[s] = index.get((shard.size, tensors, tuple(self.lengths[s])))
        self.referenced_bytes = 0
        self.filled_bytes = 0
        self._expect: dict[int, str] = {}  # arena place -> digest, where the arena holds the base's piece
        self._same: set[int] = set()  # the places of those whose new bytes memcmp found unchanged
        self._taken: dict[int, int] = {}  # of those, the ones whose checksum confirmed the base's: padded bytes
        self._record: _ArenaRecord | None = None
        self._generation = 0

    # -- the caller's thread: what the arena still holds ---------------------------------------------

    def claim(self, arena: object, tensor: object, *, fits: bool) -> None:
        """Called when this save is about to stage into ``arena`` (whose memory is ``tensor``); ``fits``:
        the whole save fits, so every unit is staged at its global offset. Takes the arena's record (and
        voids it: staging is about to overwrite it) to learn which units may be compared there."""
        with _records_lock:
            record = _records.get(arena)
            if record is None:
                record = _records[arena] = _ArenaRecord()
            held = record.units if record.tensor is not None and record.tensor() is tensor else None
            record.tensor, record.units = weakref.ref(tensor), None
            record.generation += 1
            self._record, self._generation = (record, record.generation) if fits else (None, 0)
        if held is None or self.base is None or not fits:
            return
        for u in self.plan.units:
            match = self.matches[u.shard]
            if u.end >= 0 or match is None:
                continue
            piece = self.base.shards[match].content[self._piece[(u.shard, u.file_offset)]]
            if held.get(u.global_offset) == (u.length, u.padded, piece[1]) and piece[0] == u.padded:
                self._expect[u.global_offset] = piece[1]

    def expects(self, u: Unit) -> bool:
        """True when the arena holds, where ``u`` is staged, the bytes of the base's piece at ``u``'s place:
        staging then compares before it copies (:meth:`HostCopier.copy_changed`)."""
        return u.global_offset in self._expect

    def compare_staged(
        self,
        copy_changed: Callable[[list[tuple[int, int, int]]], list[bool]],
        copies: Sequence[tuple[Unit, tuple[int, int, int]]],
    ) -> None:
        """Stage units that :meth:`expects` with ``copy_changed`` (``HostCopier.copy_changed``: compare, copy
        what differs; per copy, True when nothing did), given as ``(unit, (arena address, source address,
        length))``; remember the unchanged ones for the writer threads."""
        same = copy_changed([copy for _, copy in copies])
        self._same.update(u.global_offset for (u, _), equal in zip(copies, same, strict=True) if equal)

    # -- writer threads -----------------------------------------------------------------------------

    def unchanged(self, u: Unit) -> bool:
        return u.global_offset in self._same

    def take_unchanged(self, u: Unit, crc1: list[str], crcs: dict[int, list[str]]) -> bool:
        """For a unit staging found unchanged, whose CRC-32C the pipeline has just computed over the arena:
        True, with the base's digest recorded and the unit skipped, when that checksum equals the base's for
        the same chunk. The memcmp proved the new bytes equal the arena's; the checksum checks that the
        arena still held the base's bytes (a record gone stale by a bug would otherwise reference wrong
        bytes). False (then hashed as any unit) when it does not."""
        assert self.base is not None
        recorded = self.base.tensors[self.plan.names[u.tensor]].crc32c[u.chunk]
        computed = crcs[u.tensor][u.chunk] if u.tensor in crcs else crc1[u.tensor]
        if computed != recorded:
            log.warning(
                "step %d: the staging memory of %s (chunk %d) no longer held the bytes its record says; hashing "
                "it instead",
                self.base.step,
                self.plan.names[u.tensor],
                u.chunk,
            )
            return False
        k = self._piece[(u.shard, u.file_offset)]
        self.digests[u.shard][k] = self._expect[u.global_offset]
        self.skipped[u.shard][k] = True
        self._taken[u.global_offset] = u.padded
        return True

    @property
    def compared_bytes(self) -> int:
        """Bytes found equal to the base's by comparing them with the arena (so never hashed)."""
        return sum(self._taken.values())

    # -- writer threads -----------------------------------------------------------------------------

    def skip(self, u: Unit, segments: Sequence[tuple[int, int]], view: memoryview) -> bool:
        """Hash unit ``u`` (its staged, padded bytes at ``segments`` of ``view``); True when the base holds an
        equal piece at the same place, so the unit need not be written."""
        k = self._piece[(u.shard, u.file_offset)]
        digest = hex_digest(self.algorithm, [view[pos : pos + n] for pos, n in segments])
        self.digests[u.shard][k] = digest
        match = self.matches[u.shard]
        if match is None or self.base is None:
            return False
        if self.base.shards[match].content[k] != (u.padded, digest):
            return False
        self.skipped[u.shard][k] = True
        return True

    def take_crcs(self, u: Unit, crc1: list[str], crcs: dict[int, list[str]]) -> None:
        """Record the CRC-32C of a skipped unit ``u``: the base's, whose bytes are the same (same tensors at
        the same offsets, same SHA-256). ``crc1``/``crcs`` are the pipeline's tables (one-chunk tensors,
        tensors of several chunks)."""
        assert self.base is not None
        names, tensors = self.plan.names, self.base.tensors
        if u.end < 0:  # one chunk of one tensor
            crc = tensors[names[u.tensor]].crc32c[u.chunk]
            if u.tensor in crcs:
                crcs[u.tensor][u.chunk] = crc
            else:
                crc1[u.tensor] = crc
            return
        for i in range(u.tensor, u.end):  # a group of small tensors, one chunk each (none when empty)
            recorded = tensors[names[i]].crc32c
            crc1[i] = recorded[0] if recorded else ""

    # -- the finishing thread -----------------------------------------------------------------------

    def record(self) -> None:
        """After every unit is hashed or matched: record what the arena now holds, for the next save (unless
        a later save has begun staging into it since)."""
        if self._record is None:
            return
        units = {}
        for u in self.plan.units:
            if u.end < 0:
                units[u.global_offset] = (
                    u.length,
                    u.padded,
                    self.digests[u.shard][self._piece[(u.shard, u.file_offset)]],
                )
        with _records_lock:
            if self._record.generation == self._generation:
                self._record.units = units

    def settle(self, writers: Sequence[BlobWriter]) -> set[int]:
        """After every unit is done: discard the writers of shards referenced whole, fill the skipped pieces
        of the others from the base. Returns the indices of the referenced shards (not to be finished).
        First records what the arena holds now (:meth:`record`)."""
        self.record()
        referenced: set[int] = set()
        for s, skipped in enumerate(self.skipped):
            if not any(skipped):
                continue
            if all(skipped):
                writers[s].abort()
                referenced.add(s)
                self.referenced_bytes += self.plan.shards[s].size
                continue
            self._fill(s, writers[s])
        return referenced

    def _fill(self, s: int, writer: BlobWriter) -> None:
        """Copy the skipped pieces of shard ``s`` from the base's equal shard, checking each one's hash."""
        assert self.base is not None
        match = self.matches[s]
        assert match is not None
        source = self.base.shards[match]
        key = source.key(step_dirname(self.base.step))
        reader = self.storage.open_reader(key)
        try:
            offset = 0
            for k, n in enumerate(self.lengths[s]):
                if self.skipped[s][k]:
                    buf = memoryview(bytearray(n))
                    reader.read_into(offset, buf)
                    if hex_digest(self.algorithm, [buf]) != self.digests[s][k]:
                        raise CorruptCheckpointError(
                            f"step {self.base.step}: shard {source.file} changed since it was written (bytes "
                            f"{offset}..{offset + n} no longer match their {self.algorithm}); this incremental save "
                            "cannot reuse them",
                            step=self.base.step,
                            file=source.file,
                        )
                    writer.write_at(offset, buf)
                    self.filled_bytes += n
                offset += n
        finally:
            reader.close()

    def shard_infos(self, shards: Sequence[ShardInfo], referenced: set[int]) -> tuple[ShardInfo, ...]:
        """The manifest's shard entries: the plain ones with their content hashes, the referenced ones naming
        the base's file and the step that holds it."""
        out = []
        for s, info in enumerate(shards):
            content = tuple(zip(self.lengths[s], self.digests[s], strict=True))
            if s in referenced:
                assert self.base is not None
                match = self.matches[s]
                assert match is not None
                source = self.base.shards[match]
                holder = source.step if source.step is not None else self.base.step
                out.append(replace(info, file=source.file, content=content, step=holder))
            else:
                out.append(replace(info, content=content))
        return tuple(out)
