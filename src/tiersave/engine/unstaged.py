"""A blocking save on buffered storage, written straight from the caller's tensors: no staging copy.

A blocking ``save()`` waits until its checkpoint is durable, and a buffered write copies its bytes into the
page cache before it returns: that copy is itself the snapshot. Staging the state into the arena first
(pipeline.py) then only adds one full copy of the state (1.2 s per GiB on a loaded 2-vCPU machine). Here the
writer threads checksum each unit where it lies in the caller's tensor and hand the same bytes to ``pwrite``,
piece by piece, so each piece is read from memory once and written while it is still in the cache. The
caller's thread waits in :meth:`SourceWrite.stage` until every unit is written: once a save is *staged* no
thread reads the caller's tensors any more, the promise the staging arena gives too.

Which saves take this path (:func:`writes_from_source`): blocking, not lazy, not incremental (an incremental
save compares the new bytes with the arena's copy of the previous save instead of hashing them: it keeps
staging), every tensor in host memory (a CUDA tensor needs a host copy, and the pinned arena is that copy),
on a storage whose every write goes through the page cache (``LocalStorage`` with ``io="buffered"``, ``auto``
on a tmpfs (the memory tier ``mem://``) or where the calibration chose buffered writes, or a file system that
refused O_DIRECT). A direct write needs aligned memory: from the caller's tensors it would go through a bounce
buffer, a copy per request; object stores buffer their parts themselves.

What is written is the staged path's bytes exactly: tensors that cannot be written as they lie (not
contiguous, a conj/neg bit, a numpy array that is not C-contiguous) are made contiguous once on the caller's
thread, as staging does; the last block of a tensor whose size is not a multiple of 4096 is written from a
zeroed block (the format's padding); a group of small tensors is copied into a per-thread buffer of one group
(at most ``GROUP_BYTES``), checksummed per tensor and written with one request, since one ``pwrite`` per 1 KiB
tensor costs more than its copy.

Scope: choosing this path for a save and writing its units from the sources. Anti-scope: the layout
(plan.py), durability, manifest entries and aborting (inherited from :class:`~.pipeline.StagedWrite`),
deciding direct or buffered per request (storage/posix/policy.py).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from concurrent.futures import wait
from typing import Any

from ..format.checksum import crc32c_update
from ..format.jsonsafe import paused_gc
from ..format.layout import ALIGN
from ..storage.base import Storage
from .pipeline import SavePlan, StagedWrite, Unit
from .pool import DaemonThreadPool
from .stage import Ring, StagingArena, needs_pinned, small_memmove, source_bytes

PIECE_BYTES = 1 << 20
"""Each unit is checksummed and written in pieces of this size: the write then reads bytes the checksum has
just brought into the cache (this machine's L2 holds 1 MiB per core)."""


_SMALL_COPY = 64 << 10
"""A group whose tensors average at least this size is written from them in place (one ``pwritev``); smaller
ones are copied into one buffer (a copy of a few KiB costs less than a piece of a request)."""

_ZEROS = memoryview(bytes(ALIGN))  # the padding between tensors of a group: less than one block each


def writes_buffered(storage: Storage) -> bool:
    """True when every write to ``storage`` goes through the page cache (a ``LocalStorage`` whose I/O policy
    decides buffered for writes); False for any other storage."""
    policy = getattr(storage, "io_policy", None)
    decide = getattr(policy, "decide", None)
    if decide is None:
        return False
    # Writes take one path per file whatever their size (policy.py): one decision answers for all.
    return bool(decide("write", 1 << 30, aligned=True).path == "buffered")


def writes_from_source(storage: Storage, sources: Sequence[Any], addresses: Sequence[int | None]) -> bool:
    """Whether a blocking, non-incremental save of ``sources`` (with their host ``addresses``, None where not
    known) may be written straight from them: every value in host memory, and every write buffered."""
    if needs_pinned([s for s, a in zip(sources, addresses, strict=True) if a is None]):
        return False
    return writes_buffered(storage)


LANES_PER_FILE = 2
"""Writer threads per shard file, each writing its own half of the file's units in order. Buffered writes to one
file queue on its inode lock: four threads writing unit by unit took 1.7-2.2x the time and CPU of a plain write
of the same bytes here, two threads (one checksumming while the other writes) 1.05x, one thread 1.3x."""


def _lanes(plan: SavePlan) -> list[list[Unit]]:
    """The units of each shard cut into :data:`LANES_PER_FILE` runs of consecutive units of about equal bytes."""
    by_shard: dict[int, list[Unit]] = {}
    for u in plan.units:
        by_shard.setdefault(u.shard, []).append(u)
    lanes: list[list[Unit]] = []
    for units in by_shard.values():
        share = -(-sum(u.padded for u in units) // LANES_PER_FILE)
        lane: list[Unit] = []
        size = cut = 0
        for u in units:
            if lane and size + u.padded > share and cut < LANES_PER_FILE - 1:
                lanes.append(lane)
                lane, size, cut = [], 0, cut + 1
            lane.append(u)
            size += u.padded
        lanes.append(lane)
    return lanes


def _bytes_at(address: int, nbytes: int) -> memoryview:
    """A byte view of ``nbytes`` of host memory at ``address`` (the caller keeps its owner alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class SourceWrite(StagedWrite):
    """Writes one blocking save from its sources to ``storage`` under ``prefix``, without staging.

    The same calls as :class:`~.pipeline.StagedWrite` (``stage``, ``finish``, ``abort``), without an arena:
    ``stage`` writes every unit (on the executor's threads) and returns once all are in the page cache.
    """

    def __init__(
        self,
        storage: Storage,
        prefix: str,
        plan: SavePlan,
        sources: Sequence[Any],
        executor: DaemonThreadPool,
        addresses: Sequence[int | None] | None = None,
    ) -> None:
        self._scratch = threading.local()  # per writer thread: one group's buffer, one zeroed block
        super().__init__(storage, prefix, plan, sources, None, executor, None, None, addresses)
        if self.pinned:
            self.abort()
            raise ValueError("a save with CUDA tensors is staged: its host copy is the staging arena")
        self._keep: dict[int, Any] = {}  # contiguous copies of the sources that could not be written as they lie

    def _attach(self, arena: StagingArena | None) -> None:
        self.ring = Ring(max(ALIGN, self.plan.total_bytes))  # never waited on: aborts signal through it

    def stage(self, *, overlap: bool = True) -> None:
        """Write every unit from the sources; return once all are written (or raise the first failure)."""
        start = time.perf_counter()
        with paused_gc():
            addresses = self._addresses
            for i, (source, address) in enumerate(zip(self.sources, addresses)):
                if address is None and self.plan.nbytes[i]:
                    self._keep[i] = flat = source_bytes(source)
                    addresses[i] = flat.data_ptr()
            submit, write = self.executor.submit, self._write_lane
            self.futures.extend(submit(write, lane) for lane in _lanes(self.plan))
        wait(self.futures)
        self._keep.clear()  # the contiguous copies are written: nothing reads them any more
        self.stage_s = time.perf_counter() - start
        for fut in self.futures:
            fut.result()  # the first failure, if any: the caller aborts

    # -- writer threads -------------------------------------------------------------------------

    def _buffer(self, nbytes: int) -> tuple[memoryview, int]:
        """This thread's scratch buffer, at least ``nbytes`` long (reused by every later unit), and its address."""
        scratch = self._scratch
        if getattr(scratch, "size", 0) < nbytes:
            size = max(nbytes, ALIGN)
            scratch.array = array = (ctypes.c_char * size)()
            scratch.view, scratch.address, scratch.size = memoryview(array).cast("B"), ctypes.addressof(array), size
        return scratch.view, scratch.address

    def _write_lane(self, units: Sequence[Unit]) -> None:
        try:
            for u in units:
                if self.ring.failed:  # another lane failed: the save is lost, stop writing its files
                    return
                if u.is_group:
                    self._write_group(u)
                else:
                    self._write_chunk(u)
        except BaseException as exc:
            self.ring.fail(exc)
            raise

    def _write_chunk(self, u: Unit) -> None:
        """Checksum and write one chunk of one tensor, piece by piece; its last partial block from a copy
        padded with zeros (so the file holds the staged path's bytes, and every request is whole blocks)."""
        address = self._addresses[u.tensor]
        assert address is not None  # stage() gave every source an address
        data = _bytes_at(address + u.src_start, u.length)
        writer = self.writers[u.shard]
        whole = u.length - u.length % ALIGN
        crc = 0
        for start in range(0, whole, PIECE_BYTES):
            piece = data[start : min(whole, start + PIECE_BYTES)]
            crc = crc32c_update(crc, piece)
            writer.write_at(u.file_offset + start, piece)
        if whole < u.length:
            tail = u.length - whole
            block = self._buffer(u.padded - whole)[0][: u.padded - whole]
            block[:tail] = data[whole:]
            block[tail:] = _ZEROS[: len(block) - tail]
            crc = crc32c_update(crc, block[:tail])
            writer.write_at(u.file_offset + whole, block)
        if u.tensor in self.crcs:
            self.crcs[u.tensor][u.chunk] = f"{crc:08x}"
        else:
            self.crc1[u.tensor] = f"{crc:08x}"

    def _write_group(self, u: Unit) -> None:
        """Write a group of small tensors (zeros between them), checksumming each: with one ``pwritev`` of the
        tensors where they lie when they are large enough and the writer can, else copied into this thread's
        buffer and written with one request (a copy costs less than a piece of a request per tiny tensor)."""
        writer = self.writers[u.shard]
        write_pieces = getattr(writer, "write_pieces", None)
        if write_pieces is not None and u.length >= _SMALL_COPY * (u.end - u.tensor):
            write_pieces(u.file_offset, self._group_pieces(u))
            return
        view, base = self._buffer(u.padded)
        ctypes.memset(base, 0, u.padded)
        plan, addresses, crcs, small, large = self.plan, self._addresses, self.crc1, small_memmove, ctypes.memmove
        nbytes, offsets = plan.nbytes, plan.offsets
        for i in range(u.tensor, u.end):
            n = nbytes[i]
            if n:
                pos = offsets[i] - u.file_offset
                # a small copy keeps the GIL (cheaper than handing it over); a large one lets the others run
                (small if n < _SMALL_COPY else large)(base + pos, addresses[i] or 0, n)  # never 0: see stage()
                crcs[i] = f"{crc32c_update(0, view[pos : pos + n]):08x}"
        writer.write_at(u.file_offset, view[: u.padded])

    def _group_pieces(self, u: Unit) -> list[memoryview]:
        """The group's bytes as views of its tensors and of zeros (the padding between them), each tensor
        checksummed on the view that is written."""
        plan, addresses, crcs = self.plan, self._addresses, self.crc1
        nbytes, offsets = plan.nbytes, plan.offsets
        pieces: list[memoryview] = []
        at = u.file_offset
        for i in range(u.tensor, u.end):
            n = nbytes[i]
            if n:
                address = addresses[i]
                assert address is not None  # stage() gave every source an address
                if offsets[i] > at:
                    pieces.append(_ZEROS[: offsets[i] - at])
                data = _bytes_at(address, n)
                crcs[i] = f"{crc32c_update(0, data):08x}"
                pieces.append(data)
                at = offsets[i] + n
        end = u.file_offset + u.padded
        if end > at:
            pieces.append(_ZEROS[: end - at])
        return pieces
