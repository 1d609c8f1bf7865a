"""The staged write of one checkpoint: stage chunks into the arena ring, write them as they land.

The layout (shards, offsets, write units, groups of small tensors) is planned in plan.py. Each unit is one
aligned write straight from the page-aligned arena (so the direct-I/O path applies), its zero padding
included.

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
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .._crash import crashpoint
from ..format.checksum import crc32c_update
from ..format.jsonsafe import paused_gc
from ..format.manifest import ShardInfo, TensorEntry
from ..storage.base import BlobWriter, Storage
from .increment import Increment
from .ordering import expect_gaps, interrupt
from .plan import GROUP_BYTES as GROUP_BYTES
from .plan import SMALL_TENSOR_BYTES as SMALL_TENSOR_BYTES
from .plan import SavePlan as SavePlan
from .plan import ShardLayout as ShardLayout
from .plan import TensorSpec as TensorSpec
from .plan import Unit as Unit
from .plan import plan_layout as plan_layout
from .plan import plan_save as plan_save
from .pool import DaemonThreadPool
from .stage import HostCopier, Ring, StagingArena, copy_small, host_addresses, needs_pinned, small_memmove, source_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Written:
    """A finished write: the manifest's shard and tensor entries, and the chunk size of its checksums."""

    shards: tuple[ShardInfo, ...]
    tensors: dict[str, TensorEntry]
    chunk_bytes: int
    content_hash: str = "sha256"  # the hash function of the shards' content pieces (incremental saves)


class StagedWrite:
    """Stages one save into the arena and writes it to ``storage`` under ``prefix``."""

    def __init__(
        self,
        storage: Storage,
        prefix: str,
        plan: SavePlan,
        sources: Sequence[Any],
        arena: StagingArena | None,
        executor: DaemonThreadPool,
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
        self._attach(arena)
        # One checksum per chunk: ``crc1[i]`` for a tensor of one chunk (every member of a group), a list in
        # ``crcs`` for a tensor of several. One flat list, not a list per tensor: 10^5 small allocations on the
        # caller's thread cost more than the copy of their bytes.
        chunk = plan.chunk_bytes
        self.crc1: list[str] = [""] * len(plan.nbytes)
        self.crcs: dict[int, list[str]] = {i: [""] * -(-n // chunk) for i, n in enumerate(plan.nbytes) if n > chunk}
        self.futures: list[Future[None]] = []
        self._pending: deque[_Write] = deque()  # the writes the lanes of a bulk staging have still to take
        self.stage_s = 0.0
        self.write_s = 0.0
        self._cuda_stream: Any = None
        self._last_event: Any = None
        self._staged_event = threading.Event()
        self.writers: list[BlobWriter] = []
        self.ring.on_fail.append(partial(interrupt, self.writers))  # a failed write lets waiting writes go
        try:
            for shard in plan.shards:
                # the planned size bounds a file writer's preallocation (a killed save leaves no more)
                self.writers.append(storage.open_writer(f"{prefix}/{shard.file}", size_hint=shard.size))
        except BaseException:
            self.abort()
            raise

    def _attach(self, arena: StagingArena | None) -> None:
        """Reserve the staging memory of this save in ``arena`` (unstaged.py's writes need none)."""
        if arena is None:
            raise ValueError("a staged write needs a staging arena")
        plan, increment = self.plan, self.increment
        # The ring must hold two units to overlap staging with writing, unless the whole save fits.
        min_bytes = min(2 * plan.chunk_bytes, plan.total_bytes)
        self.arena_tensor = arena.reserve(plan.total_bytes, pinned=self.pinned, min_bytes=min_bytes)
        self.ring = Ring(int(self.arena_tensor.numel()))
        if increment is not None:  # what the arena held from the previous save, before this one overwrites it
            increment.claim(arena, self.arena_tensor, fits=plan.total_bytes <= self.ring.capacity)
        self._view = self.arena_tensor.numpy().data.cast("B")

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
        runs = _Runs(self, partial(_submit, self)) if fits and not self.pinned and inc is None else None
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
                else:  # checksummed as it is copied: the writer does not read the bytes back for it
                    crc = copier.copy_checksum(self._view, arena_ptr, pos, src_ptr, u.length)
                    self._set_crc(u, f"{crc:08x}")
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
            if runs is not None and runs.add(u):
                continue
            self.futures.append(self.executor.submit(self._write_unit, u, segments, event))
        if runs is not None:
            runs.flush()
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
        keep_alive: list[torch.Tensor] = []  # contiguous copies made by source_bytes must outlive the memmoves
        memset, memmove, sources = ctypes.memset, small_memmove, self.sources
        for u in plan.units:
            if u.is_group:
                first, end = u.tensor, u.end
                delta = arena_ptr + u.global_offset - u.file_offset
                if u.padded >= _THREADED_MEMBER_BYTES * (end - first):
                    _group_copies(u, delta, plan, addresses, sources, copies, keep_alive)
                    continue
                # tiny tensors are copied right here, one after the other: a thread would only add a
                # GIL hand-off per tensor, and a list of copies a tuple per tensor
                memset(arena_ptr + u.global_offset, 0, u.padded)
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
        work = self._pending
        runs = _Runs(self, work.append) if inc is None else None
        write = self._write_unit
        for u in plan.units:
            if runs is None or not runs.add(u):
                work.append((write, (u, [(u.global_offset, u.padded)], None)))
        if runs is not None:
            runs.flush()
        # A few lanes drain the writes, not one task each: 411 submissions took 1.5 ms of the caller's stall
        lanes = min(len(work), self.executor.workers)
        self.futures.extend(self.executor.submit(_drain, work) for _ in range(lanes))

    @property
    def addresses(self) -> list[int | None]:
        """For each source, where its bytes lie when they can be copied as they are, else None."""
        return self._addresses

    def submit_staged(self, units: Sequence[Unit], event: Any = None) -> None:
        """Submit the writes of ``units``, staged in place by engine/phased.py (``event``: after the device copies)."""
        if event is not None:
            self._last_event = event
        expect_gaps(self.writers)  # phases come in the guard's order, not in offset order
        submit, write = self.executor.submit, self._write_unit
        self.futures.extend(submit(write, u, [(u.global_offset, u.padded)], event) for u in units)

    def wait_staged(self) -> None:
        """Block until the staged bytes are in host memory (device copies complete)."""
        if self._last_event is not None:
            self._last_event.synchronize()

    # -- writer threads -------------------------------------------------------------------------

    def _write_unit(self, u: Unit, segments: list[tuple[int, int]], event: Any) -> None:
        if self.ring.failed:  # a write of this save failed: it is lost, the rest need not be written
            return
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
            elif segments and not checked and not self._checksummed(u):
                self._checksum(u, segments)
            if not segments:  # filled from the base after every write (settle): later writes must not wait for it
                expect_gaps([self.writers[u.shard]])
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
        self._set_crc(u, f"{crc:08x}")

    def _set_crc(self, u: Unit, crc: str) -> None:
        """Record the CRC-32C of unit ``u``, one whole tensor or one chunk of one (not a group)."""
        if u.tensor in self.crcs:
            self.crcs[u.tensor][u.chunk] = crc
        else:
            self.crc1[u.tensor] = crc

    def _checksummed(self, u: Unit) -> bool:
        """Whether staging already took the CRC-32C of unit ``u`` (not a group) while copying it."""
        if u.is_group:
            return False
        many = self.crcs.get(u.tensor)
        return bool(many[u.chunk] if many is not None else self.crc1[u.tensor])

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
            tensors = _entries(plan, self.crc1, self.crcs)
        shards = tuple(ShardInfo(shard_file(s.file), rank, s.size) for s in plan.shards)
        if self.increment is None:
            return Written(shards, tensors, plan.chunk_bytes)
        inc = self.increment
        return Written(inc.shard_infos(shards, referenced), tensors, plan.chunk_bytes, inc.algorithm)

    def abort(self) -> None:
        """Discard everything written (waits for in-flight writes first)."""
        self.ring.fail(_Aborted("save aborted"))
        self._pending.clear()
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


def _entries(plan: SavePlan, crc1: list[str], crcs: dict[int, list[str]]) -> dict[str, TensorEntry]:
    """The manifest entries of a written save: each tensor's place and CRC-32C (one, or one per chunk)."""
    entry = TensorEntry
    return {
        name: entry(  # a flattened shape may be a torch.Size: the manifest holds plain tuples
            name, dtype, tuple(shape), shard, offset, n, ((crc,) if i not in crcs else tuple(crcs[i])) if n else ()
        )
        for i, (name, dtype, shape, shard, offset, n, crc) in enumerate(
            zip(plan.names, plan.dtypes, plan.shapes, plan.shard_of, plan.offsets, plan.nbytes, crc1)
        )
    }


_Write = tuple[Callable[..., None], tuple[Any, ...]]
"""One write of a staged save: a writer-thread function and its arguments."""


def _submit(job: StagedWrite, write: _Write) -> None:
    fn, args = write
    job.futures.append(job.executor.submit(fn, *args))


def _drain(work: deque[_Write]) -> None:
    """Writer thread: take writes from ``work`` in order until none is left. Each lane of a bulk staging runs
    this, so the writes are dealt to whichever thread is free, as one task per write would be, for a
    submission per thread. A failure empties ``work`` (the save is lost; the other lanes stop after their
    current write) and is raised to ``finish``, which waits for every lane."""
    while True:
        try:
            fn, args = work.popleft()
        except IndexError:
            return
        try:
            fn(*args)
        except BaseException:
            work.clear()
            raise


_THREADED_MEMBER_BYTES = 64 << 10
"""A group whose tensors average at least this many bytes is staged by the copier's threads with the large
copies, only the gaps between its tensors zeroed: copied inline on the caller's thread, the groups of a GPT-like
3 GB state (91 MB in 201 groups of norms, biases and small projections) added 8-12 ms to every ``save_async``
stall, 5% of it. Groups of tinier tensors (an MoE state's thousands of experts) stay inline, where a hand-off
per tensor would cost more than its copy."""


def _group_copies(
    u: Unit,
    delta: int,
    plan: SavePlan,
    addresses: list[int | None],
    sources: Sequence[Any],
    copies: list[tuple[int, int, int]],
    keep_alive: list[torch.Tensor],
) -> None:
    """Add the copies of group ``u``'s tensors to ``copies`` (file offset + ``delta`` is the arena address)
    and zero the rest of its span now: the gaps between them and the tail (the format's zero padding). The
    zeroing runs before any copy, so whatever it covers of a tensor is overwritten by the copy after it."""
    offsets, nbytes = plan.offsets, plan.nbytes
    pos, stop = u.file_offset, u.file_offset + u.padded
    for i in range(u.tensor, u.end):
        offset, n = offsets[i], nbytes[i]
        if not n:
            continue
        if offset > pos:
            ctypes.memset(delta + pos, 0, offset - pos)
        addr = addresses[i]
        if addr is None:
            src = source_bytes(sources[i])
            keep_alive.append(src)  # a contiguous copy must outlive the memmove
            addr = src.data_ptr()
        copies.append((delta + offset, addr, n))
        pos = max(pos, offset + n)
    if stop > pos:
        ctypes.memset(delta + pos, 0, stop - pos)


class _Runs:
    """Consecutive units that each hold one whole tensor smaller than a chunk (an MoE state's experts), gathered
    into one write of up to ``chunk_bytes``: their staged bytes are contiguous in the arena and in the shard,
    so a run of 16 experts of 4 MiB is one 64 MiB request, as a large tensor's chunk is, with each expert's
    CRC-32C taken on its own bytes. Only for a save that fits its arena (a unit's place there is its global
    offset, and staging never waits for space a gathered unit holds), without device copies and not
    incremental (whose per-unit decisions skip units)."""

    def __init__(self, job: StagedWrite, push: Callable[[_Write], object]) -> None:
        self.job = job
        self.push = push  # takes each write: submits it, or queues it for the lanes
        self.units: list[Unit] = []
        self.bytes = 0

    def add(self, u: Unit) -> bool:
        """Gather ``u`` when it can join a run (True); else write the open run and return False."""
        job = self.job
        if u.is_group or u.padded >= job.plan.chunk_bytes or u.chunk:
            self.flush()
            return False
        if self.units and (u.shard != self.units[-1].shard or self.bytes + u.padded > job.plan.chunk_bytes):
            self.flush()
        self.units.append(u)
        self.bytes += u.padded
        return True

    def flush(self) -> None:
        if len(self.units) == 1:
            u = self.units[0]
            self.push((self.job._write_unit, (u, [(u.global_offset, u.padded)], None)))
        elif self.units:
            self.push((_write_run, (self.job, self.units)))
        self.units, self.bytes = [], 0


def _write_run(job: StagedWrite, units: list[Unit]) -> None:
    """Writer thread: checksum each unit of a run, write the run with one request, release its arena space."""
    first, last = units[0], units[-1]
    start, end = first.global_offset, last.global_offset + last.padded
    try:
        for u in units:
            if not job._checksummed(u):
                job._checksum(u, [(u.global_offset, u.padded)])
        job.writers[first.shard].write_at(first.file_offset, job._view[start:end])
    except BaseException as exc:
        job.ring.fail(exc)
        raise
    job.ring.release(start, end)
