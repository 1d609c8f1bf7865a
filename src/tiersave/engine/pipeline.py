"""The staged write of one checkpoint: stage chunks into the arena ring, write them as they land.

A save's tensors are cut into *units*, one per checksum chunk (at most ``chunk_bytes``), each padded to
4096 bytes. Because the format places tensor ``i+1`` at ``align_up(end of tensor i)``, the padded units
tile every shard exactly: each unit is one aligned write, straight from the page-aligned arena (so the
direct-I/O path applies), and the zero padding the format requires is written with it.

Small tensors (at most :data:`SMALL_TENSOR_BYTES` and one chunk) are not units of their own: a run of them
in one shard forms a *group* unit spanning at most :data:`GROUP_BYTES`, staged with one copy per tensor and
written, checksummed (one CRC-32C per tensor, as the format wants) and released as one job with one future.
A state of 10^5 expert tensors then costs a copy and a few attribute reads per tensor instead of a job, a
future, a lock and a write each; the bytes on disk are the same.

Call order (the Checkpointer's):

1. ``StagedWrite(...)`` opens one writer per shard (create-only).
2. ``stage()`` on the caller's thread: copies every unit into the ring and submits its write; returns
   when everything is staged (the *staged* moment). With a state larger than the ring it waits for
   writes to free space as it goes.
3. ``finish()`` on a background thread: waits for the writes, makes every shard durable, and returns
   the manifest's shard and tensor entries (:class:`Written`). ``abort()`` discards the shards after any
   failure.

Scope: moving one save's tensor bytes from the state into shard objects of a ``Storage`` (layout, staging,
checksums, parallel writes, durability). Anti-scope: flattening the state tree (state.py), naming the save's
prefix and committing it (commit.py, the checkpoint level), and everything about tiers and catalogs.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .._crash import crashpoint
from ..format.checksum import crc32c_update
from ..format.jsonsafe import paused_gc
from ..format.layout import ALIGN, align_up
from ..format.manifest import ShardInfo, TensorEntry
from ..storage.base import BlobWriter, Storage
from .increment import Increment
from .stage import HostCopier, Ring, StagingArena, copy_small, host_addresses, needs_pinned, small_memmove, source_bytes

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Unit:
    """One write of a save: either one checksum chunk of one tensor (the bytes ``[src_start, src_start +
    length)`` of tensor ``tensor``), or a *group* of consecutive small tensors ``tensor .. end - 1`` (each one
    chunk, laid out back to back at their aligned offsets). Either way it is written at ``file_offset`` of its
    shard as ``padded`` bytes, zero padding included."""

    tensor: int
    chunk: int
    shard: int
    file_offset: int
    global_offset: int
    src_start: int
    length: int
    padded: int
    end: int = -1  # a group's one-past-last tensor; -1 for a chunk of one tensor

    @property
    def is_group(self) -> bool:
        return self.end >= 0


SMALL_TENSOR_BYTES = 1 << 20
"""Tensors up to this size (and one checksum chunk) are staged, checksummed and written in groups: their cost
per tensor is then a few attribute reads and one copy, not a job, a future and a write each."""

GROUP_BYTES = 8 << 20
"""The most bytes (padding included) one group of small tensors spans: one write, one job."""


@dataclass
class ShardLayout:
    """One shard file of a save: its name, its size (a multiple of 4096) and the tensors in it (indices
    ``first .. end - 1``: the layout places tensors in order)."""

    file: str
    size: int
    first: int = 0
    end: int = 0


def plan_layout(
    nbytes: Sequence[int], files: Callable[[int], str], *, max_shard_bytes: int | None = None
) -> tuple[list[ShardLayout], list[int]]:
    """Place tensors in order at 4 KiB-aligned offsets (docs/format.md section 3), starting a new shard
    past ``max_shard_bytes``. Returns the shards and each tensor's offset in its shard."""
    shards: list[ShardLayout] = []
    offsets = [0] * len(nbytes)
    cursor = 0
    for index, size in enumerate(nbytes):
        if not shards or (max_shard_bytes is not None and cursor > 0 and cursor + size > max_shard_bytes):
            if shards:
                shards[-1].size, shards[-1].end = cursor, index
            shards.append(ShardLayout(files(len(shards)), 0, index, index))
            cursor = 0
        offsets[index] = cursor
        cursor = -(-(cursor + size) // ALIGN) * ALIGN
    if shards:
        shards[-1].size, shards[-1].end = cursor, len(nbytes)
    return shards, offsets


class TensorSpec(Protocol):
    """What the planner needs of a tensor to save (``state.FlatTensor`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...


@dataclass
class SavePlan:
    """Where every tensor of a save goes. ``names[i]`` is tensor ``i``, at ``offsets[i]`` of shard
    ``shard_of[i]``; units are in global order."""

    names: list[str]
    nbytes: list[int]
    shards: list[ShardLayout]
    units: list[Unit]
    chunk_bytes: int
    offsets: list[int] = field(default_factory=list)
    shard_of: list[int] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)


@dataclass(frozen=True)
class Written:
    """A finished write: the manifest's shard and tensor entries, and the chunk size of its checksums."""

    shards: tuple[ShardInfo, ...]
    tensors: dict[str, TensorEntry]
    chunk_bytes: int
    content_hash: str = "sha256"  # the hash function of the shards' content pieces (incremental saves)


def plan_save(
    tensors: Sequence[TensorSpec],
    *,
    chunk_bytes: int,
    shard_file: Callable[[int], str],
    max_shard_bytes: int | None = None,
    small_bytes: int = SMALL_TENSOR_BYTES,
    group_bytes: int = GROUP_BYTES,
) -> SavePlan:
    """Lay out tensors (docs/format.md offsets) and cut them into units: runs of consecutive small tensors
    (at most ``small_bytes`` each, one checksum chunk) in one shard become one group unit spanning at most
    ``group_bytes``; larger tensors get one unit per checksum chunk."""
    if chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes {chunk_bytes} is not a multiple of {ALIGN}")
    with paused_gc():
        return _plan(tensors, chunk_bytes, shard_file, max_shard_bytes, small_bytes, group_bytes)


def _plan(
    tensors: Sequence[TensorSpec],
    chunk_bytes: int,
    shard_file: Callable[[int], str],
    max_shard_bytes: int | None,
    small_bytes: int,
    group_bytes: int,
) -> SavePlan:
    names = [t.name for t in tensors]
    nbytes = [t.nbytes for t in tensors]
    shards, offsets = plan_layout(nbytes, shard_file, max_shard_bytes=max_shard_bytes)
    plan = SavePlan(
        names, nbytes, shards, [], chunk_bytes, offsets, [0] * len(names), [t.dtype for t in tensors],
        [t.shape for t in tensors],
    )  # fmt: skip
    small = min(small_bytes, chunk_bytes)
    span_limit = max(ALIGN, min(group_bytes, chunk_bytes))
    units = plan.units
    shard_of = plan.shard_of
    base = 0
    for s, shard in enumerate(shards):
        first = -1  # the open group: its first tensor, start offset and end of its last tensor's data
        g_start = g_end = 0
        shard_of[shard.first : shard.end] = [s] * (shard.end - shard.first)
        for index, size, offset in zip(
            range(shard.first, shard.end), nbytes[shard.first : shard.end], offsets[shard.first : shard.end]
        ):
            if size <= small:
                if first >= 0 and -(-(offset + size) // ALIGN) * ALIGN - g_start <= span_limit:  # align_up inline
                    g_end = offset + size
                    continue
                if first >= 0:
                    _group(units, first, index, s, g_start, g_end, base)
                first, g_start, g_end = index, offset, offset + size
                continue
            if first >= 0:
                _group(units, first, index, s, g_start, g_end, base)
                first = -1
            for c, start in enumerate(range(0, size, chunk_bytes)):
                length = min(chunk_bytes, size - start)
                off = offset + start
                units.append(Unit(index, c, s, off, base + off, start, length, align_up(length)))
        if first >= 0:
            _group(units, first, shard.end, s, g_start, g_end, base)
        base += shard.size
    return plan


def _group(units: list[Unit], first: int, end: int, shard: int, start: int, data_end: int, base: int) -> None:
    length = data_end - start
    if length:  # a run of empty tensors has nothing to write
        units.append(Unit(first, 0, shard, start, base + start, 0, length, align_up(length), end))


class StagedWrite:
    """Stages one save into the arena and writes it to ``storage`` under ``prefix``."""

    def __init__(
        self,
        storage: Storage,
        prefix: str,
        plan: SavePlan,
        sources: Sequence[Any],
        arena: StagingArena,
        executor: Executor,
        copier: HostCopier | None = None,
        increment: Increment | None = None,
        addresses: Sequence[int | None] | None = None,
    ) -> None:
        """``addresses``, when given: for each source, where its bytes lie when they can be copied as they are
        (``state.FlatTensor.address``, read while flattening), else None; not given: read here."""
        self.storage = storage
        self.increment = increment  # an incremental save: hash every unit, skip those equal to the base's
        self.prefix = prefix
        self.plan = plan
        self.sources = list(sources)
        self.executor = executor
        self.copier = copier
        if addresses is None:
            self._addresses, self.pinned = host_addresses(self.sources)
        else:  # only a value without a host address can be a device tensor
            self._addresses = list(addresses)
            self.pinned = needs_pinned([s for s, a in zip(self.sources, self._addresses) if a is None])
        # The ring must hold two units to overlap staging with writing, unless the whole save fits.
        min_bytes = min(2 * plan.chunk_bytes, plan.total_bytes)
        self.arena_tensor = arena.reserve(plan.total_bytes, pinned=self.pinned, min_bytes=min_bytes)
        self.ring = Ring(int(self.arena_tensor.numel()))
        if increment is not None:  # what the arena held from the previous save, before this one overwrites it
            increment.claim(arena, self.arena_tensor, fits=plan.total_bytes <= self.ring.capacity)
        self._view = self.arena_tensor.numpy().data.cast("B")
        # One checksum per chunk: ``crc1[i]`` for a tensor of one chunk (every member of a group), a list in
        # ``crcs`` for a tensor of several. One flat list, not a list per tensor: 10^5 small allocations on the
        # caller's thread cost more than the copy of their bytes.
        chunk = plan.chunk_bytes
        self.crc1: list[str] = [""] * len(plan.nbytes)
        self.crcs: dict[int, list[str]] = {i: [""] * -(-n // chunk) for i, n in enumerate(plan.nbytes) if n > chunk}
        self.futures: list[Future[None]] = []
        self.stage_s = 0.0
        self.write_s = 0.0
        self._cuda_stream: Any = None
        self._last_event: Any = None
        self._staged_event = threading.Event()
        self.writers: list[BlobWriter] = []
        try:
            for shard in plan.shards:
                # the planned size bounds a file writer's preallocation (a killed save leaves no more)
                self.writers.append(storage.open_writer(f"{prefix}/{shard.file}", size_hint=shard.size))
        except BaseException:
            self.abort()
            raise

    # -- caller thread --------------------------------------------------------------------------

    def stage(self, *, overlap: bool = True) -> None:
        """Copy every unit into the arena and submit its write.

        Args:
            overlap: submit each unit's write the moment it is staged, so writing overlaps copying (best
                when the caller waits for durability anyway). False, for a save whose caller only waits for
                staging: when the save fits in the arena and the state is in host memory, copy everything
                first in one parallel bulk copy and submit the writes after it, so the caller waits for
                one copy of its state without the writers competing for the same cores. CUDA tensors and
                states streaming through a smaller budget always overlap.
        """
        start = time.perf_counter()
        with paused_gc():  # a tuple per small tensor's copy: see paused_gc
            self._stage(overlap)
        self.stage_s = time.perf_counter() - start

    def _stage(self, overlap: bool) -> None:
        fits = self.plan.total_bytes <= self.ring.capacity
        if not overlap and not self.pinned and self.copier is not None and fits:
            self._stage_bulk()
            return
        if self.pinned:
            self._cuda_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            self._cuda_stream.wait_stream(torch.cuda.current_stream())
        src: torch.Tensor | None = None
        src_index = -1
        addresses, copier, inc = self._addresses, self.copier, self.increment
        arena_ptr = self.arena_tensor.data_ptr()
        for u in self.plan.units:
            self.ring.wait_free(u.global_offset + u.padded)
            segments = self.ring.segments(u.global_offset, u.padded)
            if u.is_group:
                on_cuda = self._stage_group(u, segments)
            elif copier is not None and addresses[u.tensor] is not None and len(segments) == 1:
                # A plain host tensor: copy from the address read once (while flattening, or in host_addresses).
                # Each torch call (detach, view, reshape, data_ptr) releases and retakes the GIL, which on a
                # loaded machine costs a wait behind the writer threads every time.
                pos = segments[0][0]
                src_ptr: int = addresses[u.tensor] + u.src_start  # type: ignore[operator]
                if inc is not None and inc.expects(u):
                    inc.compare_staged(copier.copy_changed, [(u, (arena_ptr + pos, src_ptr, u.length))])
                else:
                    copier.copy(arena_ptr + pos, src_ptr, u.length)
                if u.padded > u.length:
                    ctypes.memset(arena_ptr + pos + u.length, 0, u.padded - u.length)  # the format's zero padding
                on_cuda = False
            else:
                if u.tensor != src_index:  # chunks of one tensor are consecutive units
                    src, src_index = source_bytes(self.sources[u.tensor]), u.tensor
                assert src is not None
                on_cuda = self._stage_chunk(u, segments, src)
            event = None
            if on_cuda:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._cuda_stream)
                self._last_event = event
            self.futures.append(self.executor.submit(self._write_unit, u, segments, event))
        if self._last_event is not None:
            # Later kernels on the caller's stream must not change tensors before the copies read them.
            torch.cuda.current_stream().wait_event(self._last_event)

    def _copy(self, pos: int, src: torch.Tensor, first: int, take: int) -> bool:
        """Copy ``src[first : first + take]`` to arena position ``pos``; True when it was a device copy."""
        arena = self.arena_tensor
        if src.device.type == "cuda":
            with torch.cuda.stream(self._cuda_stream):
                arena[pos : pos + take].copy_(src[first : first + take], non_blocking=True)
            return True
        if self.copier is not None:
            self.copier.copy(arena.data_ptr() + pos, src.data_ptr() + first, take)
        else:
            arena[pos : pos + take].copy_(src[first : first + take])
        return False

    def _stage_chunk(self, u: Unit, segments: list[tuple[int, int]], src: torch.Tensor) -> bool:
        arena_ptr = self.arena_tensor.data_ptr()
        copied = 0
        on_cuda = False
        for pos, n in segments:
            take = max(0, min(n, u.length - copied))
            if take:
                on_cuda = self._copy(pos, src, u.src_start + copied, take) or on_cuda
            if take < n:
                ctypes.memset(arena_ptr + pos + take, 0, n - take)  # the format's zero padding
            copied += take
        return on_cuda

    def _stage_group(self, u: Unit, segments: list[tuple[int, int]]) -> bool:
        """Stage a group of small tensors: zero its span (the padding between them), copy each member."""
        arena_ptr = self.arena_tensor.data_ptr()
        for pos, n in segments:
            ctypes.memset(arena_ptr + pos, 0, n)
        plan, addresses, memmove = self.plan, self._addresses, small_memmove
        nbytes, offsets = plan.nbytes, plan.offsets
        delta = u.global_offset - u.file_offset
        wrapped = len(segments) > 1
        on_cuda = False
        for i in range(u.tensor, u.end):
            n = nbytes[i]
            if not n:
                continue
            addr = addresses[i]
            where = offsets[i] + delta
            if addr is not None and not wrapped:
                memmove(arena_ptr + where % self.ring.capacity, addr, n)
                continue
            src = source_bytes(self.sources[i])
            done = 0
            for pos, take in self.ring.segments(where, n):
                on_cuda = self._copy(pos, src, done, take) or on_cuda
                done += take
        return on_cuda

    def _stage_bulk(self) -> None:
        """Host state that fits the arena: one parallel copy of everything, then every write."""
        copier = self.copier
        if copier is None:  # stage() chooses this path only with a copier
            raise ValueError("bulk staging needs a HostCopier")
        arena_ptr = self.arena_tensor.data_ptr()
        plan, addresses = self.plan, self._addresses
        nbytes, offsets = plan.nbytes, plan.offsets
        copies: list[tuple[int, int, int]] = []  # the large copies, shared out over the copier's threads
        compares: list[tuple[Unit, tuple[int, int, int]]] = []  # where the arena may hold the same bytes already
        inc = self.increment
        keep_alive = []  # contiguous copies made by source_bytes must outlive the memmoves
        memset, memmove, sources = ctypes.memset, small_memmove, self.sources
        for u in plan.units:
            if u.is_group:
                # small tensors are copied right here, one after the other: a thread would only add a
                # GIL hand-off per tensor, and a list of copies a tuple per tensor
                first, end = u.tensor, u.end
                memset(arena_ptr + u.global_offset, 0, u.padded)
                delta = arena_ptr + u.global_offset - u.file_offset
                for i in copy_small(delta, offsets[first:end], addresses[first:end], nbytes[first:end]):
                    src = source_bytes(sources[first + i])
                    keep_alive.append(src)
                    memmove(delta + offsets[first + i], src.data_ptr(), nbytes[first + i])
                continue
            addr = addresses[u.tensor]
            if addr is None:
                src = source_bytes(self.sources[u.tensor])
                keep_alive.append(src)
                addr = src.data_ptr()
            copy = (arena_ptr + u.global_offset, addr + u.src_start, u.length)
            if inc is not None and inc.expects(u):
                compares.append((u, copy))
            else:
                copies.append(copy)
            if u.padded > u.length:
                memset(arena_ptr + u.global_offset + u.length, 0, u.padded - u.length)
        copier.copy_many(copies)
        if inc is not None and compares:
            inc.compare_staged(copier.copy_changed, compares)
        del keep_alive
        submit, write = self.executor.submit, self._write_unit
        self.futures.extend(submit(write, u, [(u.global_offset, u.padded)], None) for u in plan.units)

    @property
    def addresses(self) -> list[int | None]:
        """For each source, where its bytes lie when they can be copied as they are, else None."""
        return self._addresses

    def submit_staged(self, units: Sequence[Unit], event: Any = None) -> None:
        """Submit the writes of ``units``, staged at their own place in an arena that holds the whole save (by
        engine/phased.py); ``event``: the CUDA event after their device copies, which the writes wait for."""
        if event is not None:
            self._last_event = event
        submit, write = self.executor.submit, self._write_unit
        self.futures.extend(submit(write, u, [(u.global_offset, u.padded)], event) for u in units)

    def wait_staged(self) -> None:
        """Block until the staged bytes are in host memory (device copies complete)."""
        if self._last_event is not None:
            self._last_event.synchronize()

    # -- writer threads -------------------------------------------------------------------------

    def _write_unit(self, u: Unit, segments: list[tuple[int, int]], event: Any) -> None:
        try:
            if event is not None:
                event.synchronize()
            inc, checked = self.increment, False
            if inc is not None and inc.unchanged(u):
                # staging found the previous save's bytes here (memcmp): the CRC-32C every written chunk gets,
                # checked against the base's, stands in for the content hash (about 3x less CPU per byte)
                self._checksum(u, segments)
                checked = True
                if inc.take_unchanged(u, self.crc1, self.crcs):
                    segments = []
            if segments and inc is not None and inc.skip(u, segments, self._view):
                # the same bytes as the base checkpoint's (by content hash): referenced, not written again, and
                # their CRC-32C are the base's, so unchanged bytes are hashed rather than hashed and checksummed
                inc.take_crcs(u, self.crc1, self.crcs)
                segments = []
            elif segments and not checked:
                self._checksum(u, segments)
            offset = u.file_offset
            writer = self.writers[u.shard]
            for pos, n in segments:
                writer.write_at(offset, self._view[pos : pos + n])
                offset += n
        except BaseException as exc:
            self.ring.fail(exc)
            raise
        self.ring.release(u.global_offset, u.global_offset + u.padded)

    def _checksum(self, u: Unit, segments: list[tuple[int, int]]) -> None:
        """The CRC-32C of unit ``u`` (staged at ``segments``) into ``crc1``/``crcs``."""
        if u.is_group:
            self._checksum_group(u, segments)
            return
        crc, seen = 0, 0
        for pos, n in segments:
            take = max(0, min(n, u.length - seen))
            if take:
                crc = crc32c_update(crc, self._view[pos : pos + take])
            seen += n
        if u.tensor in self.crcs:
            self.crcs[u.tensor][u.chunk] = f"{crc:08x}"
        else:
            self.crc1[u.tensor] = f"{crc:08x}"

    def _checksum_group(self, u: Unit, segments: list[tuple[int, int]]) -> None:
        nbytes, offsets, crcs, view = self.plan.nbytes, self.plan.offsets, self.crc1, self._view
        if len(segments) == 1:
            delta = segments[0][0] - u.file_offset
            for i in range(u.tensor, u.end):
                n = nbytes[i]
                if n:
                    p = offsets[i] + delta
                    crcs[i] = f"{crc32c_update(0, view[p : p + n]):08x}"
            return
        delta = u.global_offset - u.file_offset
        for i in range(u.tensor, u.end):
            n = nbytes[i]
            if n:
                crc = 0
                for pos, take in self.ring.segments(offsets[i] + delta, n):
                    crc = crc32c_update(crc, view[pos : pos + take])
                crcs[i] = f"{crc:08x}"

    # -- background thread ----------------------------------------------------------------------

    def finish(self, shard_file: Callable[[str], str], *, rank: int = 0) -> Written:
        """Wait for every unit's write and make every shard durable.

        Args:
            shard_file: the manifest's ``file`` for a shard written at ``f"{prefix}/{name}"`` (the commit
                protocol's ``shard_file``).
            rank: the rank recorded as the writer of these shards.

        Returns:
            The manifest entries of what was written, checksums included.
        """
        start = time.perf_counter()
        wait(self.futures)
        for fut in self.futures:
            fut.result()  # the first failure, if any
        crashpoint("after_shard_write")
        referenced = self.increment.settle(self.writers) if self.increment is not None else set()
        # On the writer threads, now idle: an incremental save's many small shards each wait for an fsync
        syncs = [
            self.executor.submit(writer.finish, shard.size)
            for index, (shard, writer) in enumerate(zip(self.plan.shards, self.writers))
            if index not in referenced
        ]
        wait(syncs)
        for sync in syncs:
            sync.result()
        crashpoint("after_shard_fsync")
        self.write_s = time.perf_counter() - start
        plan = self.plan
        with paused_gc():
            tensors = self._entries()
        shards = tuple(ShardInfo(shard_file(s.file), rank, s.size) for s in plan.shards)
        if self.increment is None:
            return Written(shards, tensors, plan.chunk_bytes)
        inc = self.increment
        return Written(inc.shard_infos(shards, referenced), tensors, plan.chunk_bytes, inc.algorithm)

    def _entries(self) -> dict[str, TensorEntry]:
        plan, entry, many = self.plan, TensorEntry, self.crcs
        return {
            name: entry(  # a flattened shape may be a torch.Size: the manifest holds plain tuples
                name, dtype, tuple(shape), shard, offset, n, ((crc,) if i not in many else tuple(many[i])) if n else ()
            )
            for i, (name, dtype, shape, shard, offset, n, crc) in enumerate(
                zip(plan.names, plan.dtypes, plan.shapes, plan.shard_of, plan.offsets, plan.nbytes, self.crc1)
            )
        }

    def abort(self) -> None:
        """Discard everything written (waits for in-flight writes first)."""
        self.ring.fail(_Aborted("save aborted"))
        for fut in self.futures:
            fut.cancel()
        wait(self.futures)
        for writer in self.writers:
            try:
                writer.abort()
            except Exception:  # the original failure matters more
                log.warning("could not discard %s", writer.key, exc_info=True)


class _Aborted(Exception):
    pass
