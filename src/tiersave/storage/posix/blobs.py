"""The POSIX backend's blob writer and reader: one file, many threads, direct or buffered per request.

Scope: :class:`LocalBlobWriter` (writes at any offsets into a new file: whole blocks direct or buffered
as the policy decides, unaligned edges merged into blocks, preallocation, ``fsync`` at ``finish``) and
:class:`LocalBlobReader` (reads ranges direct or buffered; on request the CRC-32C of what a read filled,
taken in the same pass as the copy out of bounce buffers: :class:`ChecksumSink`), with the statistics of
what each moved.
Anti-scope: opening the files and everything else of the storage protocol
(:class:`~tiersave.storage.posix.LocalStorage`), the system calls of direct I/O
(:mod:`tiersave.storage.posix.directio`), the rules choosing a path (:mod:`tiersave.storage.posix.policy`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ...errors import CorruptCheckpointError, StorageError
from ...format.checksum import copy_checksum, crc32c_update
from .buffers import address_of
from .directio import (
    BouncePool,
    DioAlignment,
    PartialBlocks,
    dio_alignment,
    is_refusal,
    pread_direct,
    preallocate,
    pwrite_direct,
    split_aligned,
)
from .files import os_errors, read_all, write_all, writev_all
from .policy import Decision, IOPolicy, IOStats
from .vectored import pread_ranges_direct
from .writeback import Writeback

log = logging.getLogger(__name__)

__all__ = ["BlobHost", "ChecksumSink", "LocalBlobReader", "LocalBlobWriter"]

_MAX_PENDING_BYTES = 64 << 20
_PREALLOC_STEP_BYTES = 256 << 20


class BlobHost(Protocol):
    """What a writer or reader uses of the storage that opened it.

    :class:`~tiersave.storage.posix.LocalStorage` provides it; the writers and readers add their
    statistics to its ``io_stats`` when they finish or close.
    """

    @property
    def uri(self) -> str: ...

    @property
    def io_policy(self) -> IOPolicy: ...

    @property
    def bounce_pool(self) -> BouncePool: ...

    @property
    def io_stats(self) -> IOStats: ...


class LocalBlobWriter:
    """Writes one new file from any number of threads, direct or buffered per request.

    Each ``write_at`` splits its range at the file's direct-I/O block size: whole blocks go direct (in
    place when the source address allows, else through a bounce buffer) or buffered as the policy
    decides; the unaligned edges are merged into zero-filled blocks written at ``finish`` (see
    :class:`~tiersave.storage.posix.directio.PartialBlocks` for why that gives the same bytes). Once more than
    ``_MAX_PENDING_BYTES`` of edges are pending, they and every later edge go buffered instead, which keeps
    memory bounded for writers that send many tiny pieces.

    Buffered writes start their writeback early, every few MiB each thread writes in a row
    (:class:`~tiersave.storage.posix.writeback.Writeback`), so ``finish``'s ``fsync`` finds little left to write.

    Attributes:
        io_stats: what this writer moved on each path (thread-safe).
    """

    def __init__(
        self,
        storage: BlobHost,
        key: str,
        fd: int,
        dfd: int | None = None,
        *,
        discard: Callable[[], None],
        size_hint: int | None = None,
    ) -> None:
        self.key = key
        self._storage = storage
        self._discard = discard  # removes the file by its key (walked again without following links)
        self._fd: int | None = fd
        self._dfd = dfd
        self.io_stats = IOStats()
        self._align: DioAlignment = dio_alignment(dfd) if dfd is not None else DioAlignment(4096, 4096)
        self._edges = PartialBlocks(self._align.offset) if dfd is not None else None
        self._edges_buffered = False
        self._lock = threading.Lock()
        self._reserved = 0  # bytes preallocated from the start of the file (see _reserve)
        self._prealloc = dfd is not None
        # Never preallocate past the size the caller announced: a save killed midway leaves at most that.
        align = self._align.offset
        self._prealloc_limit = None if size_hint is None else -(-size_hint // align) * align
        try:  # a memory file system has nothing to write back: its page cache is the storage
            self._writeback = Writeback(fd, key, self.io_stats, step=0 if storage.io_policy.memory_fs else None)
            if dfd is None and self._writeback.enabled and self._prealloc_limit:
                # Blocks allocated at writeback, range by range, from two threads interleave on disk (63-68
                # extents for 1 GiB, against 11-29 written at the fsync), and deleting the file takes longer
                # (docs/benchmarks.md): allocate them all now, in one piece where the file system can.
                with os_errors(storage.uri, "creating", key):
                    preallocate(fd, 0, self._prealloc_limit)
        except BaseException:  # a bad TIERSAVE_WRITEBACK_BYTES, a failed preallocation: the new file goes again
            self.abort()
            raise

    @property
    def direct(self) -> bool:
        """True while this writer can issue direct I/O."""
        return self._dfd is not None

    def write_at(self, offset: int, data: memoryview) -> None:
        fd = self._fd
        if fd is None:
            raise StorageError(f"{self.key!r}: write after finish/abort", tier=self._storage.uri, key=self.key)
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        n = len(view)
        if n == 0:
            return
        with os_errors(self._storage.uri, "writing", self.key):
            if self._edges is None:  # no direct descriptor: say why in the statistics, write buffered
                self.io_stats.note(self._storage.io_policy.decide("write", n, aligned=False).reason)
                start = time.perf_counter()
                write_all(fd, view, offset)
                self.io_stats.record("buffered", n, time.perf_counter() - start)
                self._writeback.wrote(offset, n)
                return
            head, middle, tail = split_aligned(offset, n, self._align.offset)
            if head:
                self._add_edge(fd, offset, view[:head])
            if tail:
                self._add_edge(fd, offset + n - tail, view[n - tail :])
            if middle:
                self._write_blocks(fd, offset + head, view[head : head + middle])

    def write_pieces(self, offset: int, pieces: Sequence[memoryview]) -> None:
        """Write the concatenation of ``pieces`` (byte views) at ``offset``: one ``pwritev`` where this writer
        writes buffered (no direct descriptor), so pieces scattered in memory need no copy into one buffer;
        else piece by piece through :meth:`write_at` (its direct and edge rules)."""
        fd = self._fd
        if fd is None or self._edges is not None:
            for piece in pieces:
                self.write_at(offset, piece)
                offset += len(piece)
            return
        n = sum(len(p) for p in pieces)
        with os_errors(self._storage.uri, "writing", self.key):
            self.io_stats.note(self._storage.io_policy.decide("write", n, aligned=False).reason)
            start = time.perf_counter()
            writev_all(fd, pieces, offset)
            self.io_stats.record("buffered", n, time.perf_counter() - start)
            self._writeback.wrote(offset, n)

    def _reserve(self, dfd: int, end: int) -> None:
        """Preallocate the file up to at least ``end`` so that direct writes are in-place overwrites.

        The file grows in steps of ``_PREALLOC_STEP_BYTES`` (or an eighth of its size), bounded by the size
        hint given to ``open_writer``; without one, a step never more than doubles what was written, so a
        writer killed midway leaves at most about twice the bytes it had written. ``finish`` trims the excess.
        """
        if not self._prealloc or end <= self._reserved:
            return
        with self._lock:
            if not self._prealloc or end <= self._reserved:
                return
            grow = max(_PREALLOC_STEP_BYTES, self._reserved // 8)
            limit = self._prealloc_limit
            if limit is None:
                grow = min(grow, max(end, self._reserved))
            target = max(end, self._reserved + grow)
            if limit is not None:
                target = max(end, min(target, limit))
            if preallocate(dfd, self._reserved, target - self._reserved):
                self._reserved = target
            elif target > end and preallocate(dfd, self._reserved, end - self._reserved):
                self._reserved = end
            else:
                self._prealloc = False  # not supported, or no room for more: plain writes from now on

    def _write_blocks(self, fd: int, offset: int, view: memoryview) -> None:
        policy = self._storage.io_policy
        aligned = address_of(view) % self._align.memory == 0
        decision = policy.decide("write", len(view), aligned=aligned)
        self.io_stats.note(decision.reason)
        log.debug("%s: write %d B at %d: %s (%s: %s)", self.key, len(view), offset, *_describe(decision))
        dfd = self._dfd
        start = time.perf_counter()
        if decision.path == "direct" and dfd is not None:
            self._reserve(dfd, offset + len(view))
            try:
                bounced = pwrite_direct(dfd, view, offset, self._align, self._storage.bounce_pool)
            except OSError as exc:
                if not is_refusal(exc):
                    raise
                policy.mark_refused(f"{exc.strerror} on a direct write")
            else:
                self.io_stats.record("direct-bounce" if bounced else "direct", len(view), time.perf_counter() - start)
                return
        # Whole blocks that no other write touches: buffered and direct writes of other blocks may mix.
        write_all(fd, view, offset)
        self.io_stats.record("buffered", len(view), time.perf_counter() - start)
        self._writeback.wrote(offset, len(view))

    def _add_edge(self, fd: int, offset: int, piece: memoryview) -> None:
        edges = self._edges
        if edges is None:
            write_all(fd, piece, offset)
            return
        start = time.perf_counter()
        with self._lock:
            if self._edges_buffered:
                write_all(fd, piece, offset)
                self.io_stats.record("buffered", len(piece), time.perf_counter() - start)
                return
            edges.add(offset, piece)
            if edges.pending_bytes > _MAX_PENDING_BYTES:
                # Too many tiny pieces to hold: write them (and all later ones) through the page cache.
                flushed = edges.flush_buffered(fd)
                self._edges_buffered = True
                self.io_stats.record("buffered", flushed, time.perf_counter() - start)
                log.debug("%s: over %d B of unaligned pieces; writing edges buffered", self.key, _MAX_PENDING_BYTES)

    def _flush_edges(self, fd: int) -> None:
        edges = self._edges
        if edges is None or self._edges_buffered or not len(edges):
            return
        start = time.perf_counter()
        dfd = self._dfd
        if dfd is not None and not self._storage.io_policy.refused:
            try:
                self._reserve(dfd, max(off + sum(len(b) for b in blocks) for off, blocks in edges.runs()))
                written = edges.flush_direct(dfd, self._align, self._storage.bounce_pool)
            except OSError as exc:
                if not is_refusal(exc):
                    raise
                self._storage.io_policy.mark_refused(f"{exc.strerror} on a direct write")
            else:
                self.io_stats.record("blocks", written, time.perf_counter() - start)
                return
        written = edges.flush_buffered(fd)
        self.io_stats.record("buffered", written, time.perf_counter() - start)

    def finish(self, size: int) -> None:
        fd = self._fd
        if fd is None:
            raise StorageError(f"{self.key!r}: finish after abort", tier=self._storage.uri, key=self.key)
        with os_errors(self._storage.uri, "syncing", self.key):
            try:
                self._flush_edges(fd)
                os.ftruncate(fd, size)
                # O_DIRECT bypasses the page cache but not the device cache nor the file's metadata: fsync
                # always. An fsync error means this file is lost: never retried (fsyncgate).
                os.fsync(fd)
            finally:
                self._close()
                self._storage.io_stats.merge(self.io_stats)

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        dfd, self._dfd = self._dfd, None
        for f in (dfd, fd):
            if f is not None:
                os.close(f)
        if self._edges is not None:
            self._edges.clear()

    def abort(self) -> None:
        self._close()
        self._discard()


class ChecksumSink:
    """The CRC-32C of the bytes a direct read fills (a :class:`~tiersave.storage.posix.directio.ReadSink`).

    Bounced bytes are copied out and checksummed piece by piece, so the checksum reads each piece from
    cache instead of reading the whole range back from memory afterwards; bytes that landed in place are
    checksummed where they landed (they are in no cache then, but there is no copy to fuse with).

    Attributes:
        crc: the CRC-32C of every byte seen so far, in file order.
    """

    __slots__ = ("crc",)

    def __init__(self) -> None:
        self.crc = 0

    def copy(self, dst: memoryview, src: memoryview) -> None:
        self.crc = copy_checksum(self.crc, dst, address_of(dst), address_of(src))

    def landed(self, view: memoryview) -> None:
        self.crc = crc32c_update(self.crc, view)


class LocalBlobReader:
    """Reads ranges of one regular file from any number of threads, direct or buffered per request.

    Attributes:
        io_stats: what this reader moved on each path (thread-safe).
    """

    def __init__(self, storage: BlobHost, key: str, fd: int, dfd: int | None = None) -> None:
        self.key = key
        self._storage = storage
        self._fd = fd
        self._dfd = dfd
        self.size = os.fstat(fd).st_size
        self.io_stats = IOStats()
        self._align: DioAlignment = dio_alignment(dfd) if dfd is not None else DioAlignment(4096, 4096)
        with contextlib.suppress(OSError, AttributeError):
            # Doubles the kernel's read-ahead window for the buffered path (chunks are read in order).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def read_into(self, offset: int, out: memoryview) -> None:
        self._read(offset, out, None)

    def read_into_crc(self, offset: int, out: memoryview) -> int:
        """Fill ``out`` as :meth:`read_into` does and return the CRC-32C of the bytes it now holds.

        Bytes that pass through a bounce buffer are checksummed in the same pass as their copy out, piece
        by piece while each piece is still in cache; bytes read in place (or buffered) after they landed.
        """
        sink = ChecksumSink()
        self._read(offset, out, sink)
        return sink.crc

    def _read(self, offset: int, out: memoryview, sink: ChecksumSink | None) -> None:
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        n = len(view)
        if n == 0:
            return
        with os_errors(self._storage.uri, "reading", self.key):
            dfd = self._dfd
            start = time.perf_counter()
            if dfd is not None:
                head, _, _ = split_aligned(offset, n, self._align.offset)
                aligned = (address_of(view) + head) % self._align.memory == 0
                policy = self._storage.io_policy
                decision = policy.decide("read", n, aligned=aligned)
                self.io_stats.note(decision.reason)
                log.debug("%s: read %d B at %d: %s (%s: %s)", self.key, n, offset, *_describe(decision))
                if decision.path == "direct":
                    try:
                        filled, bounced = pread_direct(dfd, view, offset, self._align, self._storage.bounce_pool, sink)
                    except OSError as exc:
                        if not is_refusal(exc):
                            raise
                        policy.mark_refused(f"{exc.strerror} on a direct read")
                        if sink is not None:  # the buffered read below fills (and checksums) every byte again
                            sink.crc = 0
                    else:
                        if filled < n:
                            raise CorruptCheckpointError(
                                f"{self.key!r} ends before byte {offset + n} (read stopped at {offset + filled})",
                                file=self.key,
                            )
                        seconds = time.perf_counter() - start
                        if bounced:
                            self.io_stats.record("direct-bounce", bounced, seconds * bounced / n)
                        if filled - bounced:
                            self.io_stats.record("direct", filled - bounced, seconds * (filled - bounced) / n)
                        return
            else:  # no direct descriptor: say why in the statistics
                self.io_stats.note(self._storage.io_policy.decide("read", n, aligned=False).reason)
            self._read_buffered(view, offset, sink)
            self.io_stats.record("buffered", n, time.perf_counter() - start)

    def read_ranges(self, ranges: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, out)`` of ``ranges`` (sorted by offset, not overlapping) with the file's bytes.

        Direct, a run of consecutive ranges is read with a few large vectored requests (in place where a
        buffer is aligned) instead of one request per range; buffered, range by range.
        """
        self._read_ranges(ranges, None)

    def read_ranges_crc(self, ranges: Sequence[tuple[int, memoryview]]) -> list[int]:
        """Fill ``ranges`` as :meth:`read_ranges` does; return the CRC-32C of each range's bytes after it,
        bounced bytes checksummed in the same pass as their copy out (as :meth:`read_into_crc`)."""
        sinks = [ChecksumSink() for _ in ranges]
        self._read_ranges(ranges, sinks)
        return [sink.crc for sink in sinks]

    def _read_ranges(self, ranges: Sequence[tuple[int, memoryview]], all_sinks: list[ChecksumSink] | None) -> None:
        views = [(off, out.cast("B") if out.format != "B" or out.ndim != 1 else out) for off, out in ranges]
        keep = [i for i, (_, v) in enumerate(views) if len(v)]
        views = [views[i] for i in keep]
        sinks = None if all_sinks is None else [all_sinks[i] for i in keep]
        if not views:
            return
        n = sum(len(v) for _, v in views)
        with os_errors(self._storage.uri, "reading", self.key):
            dfd = self._dfd
            start = time.perf_counter()
            if dfd is not None:
                off0, first = views[0]
                head, _, _ = split_aligned(off0, len(first), self._align.offset)
                aligned = (address_of(first) + head) % self._align.memory == 0
                policy = self._storage.io_policy
                decision = policy.decide("read", n, aligned=aligned)
                self.io_stats.note(decision.reason)
                if decision.path == "direct":
                    try:
                        in_place, bounced, end = pread_ranges_direct(
                            dfd, views, self._align, self._storage.bounce_pool, sinks=sinks
                        )
                    except OSError as exc:
                        if not is_refusal(exc):
                            raise
                        policy.mark_refused(f"{exc.strerror} on a direct read")
                        for sink in sinks or ():  # the buffered reads below fill (and checksum) every byte again
                            sink.crc = 0
                    else:
                        want = views[-1][0] + len(views[-1][1])
                        if end < want:
                            raise CorruptCheckpointError(
                                f"{self.key!r} ends before byte {want} (read stopped at {end})", file=self.key
                            )
                        seconds = time.perf_counter() - start
                        if bounced:
                            self.io_stats.record("direct-bounce", bounced, seconds * bounced / n)
                        if in_place:
                            self.io_stats.record("direct", in_place, seconds * in_place / n)
                        return
            else:
                self.io_stats.note(self._storage.io_policy.decide("read", n, aligned=False).reason)
            for i, (off, view) in enumerate(views):
                self._read_buffered(view, off, None if sinks is None else sinks[i])
            self.io_stats.record("buffered", n, time.perf_counter() - start)

    def _read_buffered(self, view: memoryview, offset: int, sink: ChecksumSink | None) -> None:
        if sink is None:
            read_all(self._fd, view, offset, self.key)
            return
        # Whole, then checksummed. Read piece by piece with each piece checksummed right after it (commit
        # 83f6c6b) one thread went from 251 to 188 ms per GiB from tmpfs, but mem:// restores of 1-2 GB did not
        # change beyond their noise (docs/benchmarks.md, "The restore's copy and checksum in one pass").
        read_all(self._fd, view, offset, self.key)
        sink.landed(view)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        dfd, self._dfd = self._dfd, None
        if dfd is not None:
            os.close(dfd)
        if fd >= 0:
            os.close(fd)
            self._storage.io_stats.merge(self.io_stats)

    def __enter__(self) -> LocalBlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(decision: Decision) -> tuple[str, str, str]:
    return decision.path, decision.reason, decision.detail
