"""O_DIRECT reads and writes: aligned bulk in place or through bounce buffers, unaligned edges merged.

Scope: the mechanics of direct I/O on one file descriptor. Opening a file with ``O_DIRECT`` (and
telling "this file system refuses it" apart from real errors), the alignment the kernel demands
(``statx(STATX_DIOALIGN)``, else 4096), splitting a request into an aligned middle and unaligned edges,
moving the middle straight between the caller's memory and the disk when its address allows and through
a small reusable pool of page-aligned *bounce buffers* when it does not, and merging the unaligned edges
of writes into whole zero-filled pages that are written at the end. Anti-scope: *whether* to use direct
I/O for a request (:mod:`tiersave.storage.posix.policy`), durability (the caller ``fsync``-s: O_DIRECT bypasses
the page cache but does not flush the device's write cache nor the file's metadata), error mapping
(the storage backend maps ``OSError``).

Why edges are merged rather than written buffered: a direct write must cover whole aligned blocks, and a
block that holds the tail of one write and the head of another cannot be written by either alone without
erasing the other's bytes. A new file (``O_EXCL``) reads as zeros where nothing was written, so collecting
every partial-block piece in a zero-filled block and writing that block once, after all writes returned,
gives exactly the bytes a buffered writer would have produced. The checkpoint format puts every tensor
at a 4 KiB-aligned offset, so in practice only the last block of each tensor is partial.

Thread safety: every function here may be called from many threads at once on the same descriptor
(``pread``/``pwrite`` are positional). :class:`BouncePool` and :class:`PartialBlocks` are thread-safe.

Performance notes (measured on the reference machine, see docs/benchmarks.md): memcpy runs at about
10 GB/s per core and CRC-32C at 13 GB/s, while the disk writes at about 2 GB/s, so a bounce copy costs
well under a tenth of the I/O time and runs on another thread while the disk works.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ...format.layout import ALIGN, align_up
from .buffers import address_of, aligned_buffer

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "BouncePool",
    "DioAlignment",
    "PartialBlocks",
    "ReadSink",
    "dio_alignment",
    "open_direct",
    "pread_direct",
    "preallocate",
    "probe_direct_io",
    "pwrite_direct",
    "refuse_direct_io",
    "split_aligned",
]

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

DEFAULT_BLOCK_BYTES = 8 << 20
"""Bounce buffer size: large enough that one syscall moves several of the device's 4 MiB requests,
small enough that a pool for 8 threads stays under 64 MiB."""

# Errors that mean "this file system (or this descriptor) does not do O_DIRECT", not "the I/O failed".
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


# -- alignment ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DioAlignment:
    """What the kernel requires of a direct I/O on one file.

    Attributes:
        memory: the buffer address must be a multiple of this.
        offset: the file offset and the length must be multiples of this.
        source: ``"statx"`` when the kernel reported it, ``"default"`` when it is the safe guess (4096).
    """

    memory: int
    offset: int
    source: str = "default"


_DEFAULT_ALIGNMENT = DioAlignment(ALIGN, ALIGN, "default")
_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000


class _StatxTimestamp(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_uint32), ("reserved", ctypes.c_int32)]


class _Statx(ctypes.Structure):
    # struct statx from linux/stat.h (stable ABI); only the fields up to the DIO alignment are used.
    _fields_ = [
        ("stx_mask", ctypes.c_uint32),
        ("stx_blksize", ctypes.c_uint32),
        ("stx_attributes", ctypes.c_uint64),
        ("stx_nlink", ctypes.c_uint32),
        ("stx_uid", ctypes.c_uint32),
        ("stx_gid", ctypes.c_uint32),
        ("stx_mode", ctypes.c_uint16),
        ("spare0", ctypes.c_uint16),
        ("stx_ino", ctypes.c_uint64),
        ("stx_size", ctypes.c_uint64),
        ("stx_blocks", ctypes.c_uint64),
        ("stx_attributes_mask", ctypes.c_uint64),
        ("stx_atime", _StatxTimestamp),
        ("stx_btime", _StatxTimestamp),
        ("stx_ctime", _StatxTimestamp),
        ("stx_mtime", _StatxTimestamp),
        ("stx_rdev_major", ctypes.c_uint32),
        ("stx_rdev_minor", ctypes.c_uint32),
        ("stx_dev_major", ctypes.c_uint32),
        ("stx_dev_minor", ctypes.c_uint32),
        ("stx_mnt_id", ctypes.c_uint64),
        ("stx_dio_mem_align", ctypes.c_uint32),
        ("stx_dio_offset_align", ctypes.c_uint32),
        ("spare3", ctypes.c_uint64 * 12),
    ]


def _load_statx() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_statx = _load_statx()


def dio_alignment(fd: int) -> DioAlignment:
    """The direct-I/O alignment the kernel requires for the open file ``fd``.

    Uses ``statx(STATX_DIOALIGN)`` (Linux 6.1+) for the memory alignment. Where the kernel or file
    system does not report it, or reports something odd, returns 4096 for both, which every Linux block
    device accepts. The offset alignment is never below 4096 even where the kernel accepts 512: a direct
    write of part of a file-system block makes ext4 zero the rest of the block under an exclusive lock,
    and 4096 is the checkpoint format's own block.
    """
    if _statx is None:
        return _DEFAULT_ALIGNMENT
    buf = _Statx()
    rc = _statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, ctypes.byref(buf))
    if rc != 0 or not buf.stx_mask & _STATX_DIOALIGN:
        return _DEFAULT_ALIGNMENT
    mem, off = int(buf.stx_dio_mem_align), int(buf.stx_dio_offset_align)
    if mem <= 0 or off < 512 or off > ALIGN or mem > ALIGN or mem & (mem - 1) or off & (off - 1):
        return _DEFAULT_ALIGNMENT
    return DioAlignment(mem, max(off, ALIGN), "statx")


def split_aligned(offset: int, length: int, align: int) -> tuple[int, int, int]:
    """Split ``[offset, offset + length)`` into an unaligned head, an aligned middle and a tail.

    Returns:
        ``(head, middle, tail)`` lengths that sum to ``length``. The middle starts and ends on multiples
        of ``align``; a request that holds no whole aligned block is all head.

    >>> split_aligned(4096, 10000, 4096)
    (0, 8192, 1808)
    >>> split_aligned(100, 50, 4096)
    (50, 0, 0)
    """
    end = offset + length
    mid_start = align_up(offset, align)
    mid_end = end - end % align
    if mid_end <= mid_start:
        return length, 0, 0
    return mid_start - offset, mid_end - mid_start, end - mid_end


# -- opening -----------------------------------------------------------------------------------------

_fault_lock = threading.Lock()
_refuse_depth = 0


@contextlib.contextmanager
def refuse_direct_io() -> Iterator[None]:
    """Make every :func:`open_direct` in this process fail with ``EINVAL``, as a file system without
    O_DIRECT support does (for tests of the fallback; real refusals come from e.g. ramfs)."""
    global _refuse_depth
    with _fault_lock:
        _refuse_depth += 1
    try:
        yield
    finally:
        with _fault_lock:
            _refuse_depth -= 1


def open_direct(
    path: str | os.PathLike[str], flags: int, mode: int = 0o644, *, dir_fd: int | None = None
) -> int | None:
    """Open ``path`` (relative to ``dir_fd`` when given) with ``O_DIRECT`` added to ``flags``, never
    following a final symbolic link.

    Returns:
        The descriptor, or None when the file system refuses direct I/O (``EINVAL``/``EOPNOTSUPP`` on
        open, or a platform without ``O_DIRECT``). Every other error is raised.

    Raises:
        OSError: the open failed for another reason (missing file, permission...).
    """
    if not O_DIRECT:
        return None
    if _refuse_depth:
        return None
    try:
        return os.open(path, flags | O_DIRECT | _O_NOFOLLOW | _O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _REFUSED:
            log.debug("O_DIRECT refused for %s: %s", path, exc)
            return None
        raise


def probe_direct_io(directory: str | os.PathLike[str]) -> bool:
    """True when files in ``directory`` can be opened with ``O_DIRECT`` (creates and removes a probe file).

    Raises:
        OSError: the directory is not writable or does not exist.
    """
    path = os.path.join(os.fspath(directory), f".tiersave-dio-probe-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o600)
    try:
        os.close(fd)
        dfd = open_direct(path, os.O_WRONLY)
        if dfd is None:
            return False
        os.close(dfd)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def is_refusal(exc: OSError) -> bool:
    """True when a direct read or write failed because O_DIRECT is not possible here (retry buffered)."""
    return exc.errno in _REFUSED


# -- preallocation ----------------------------------------------------------------------------------


def _load_fallocate() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate64
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_fallocate = _load_fallocate()


def preallocate(fd: int, offset: int, length: int) -> bool:
    """Allocate ``[offset, offset + length)`` and extend the file's size to cover it (``fallocate`` mode 0).

    Why: ext4 (and XFS) run a direct write that extends the file, or that lands in a hole, under the
    inode's exclusive lock and wait for it to complete, so parallel direct writes to a growing file run
    one at a time. Into allocated blocks inside the file's size they run under a shared lock, in parallel.
    The allocated blocks read as zeros until written.

    Returns:
        False when the file system cannot preallocate (``EOPNOTSUPP``, ``ENOSYS``) or is out of space;
        the caller then simply writes without preallocating (a real lack of space fails the write).

    Raises:
        OSError: any other failure (``EBADF``, ``EIO``...).
    """
    if _fallocate is None or length <= 0:
        return False
    if _fallocate(fd, 0, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


# -- bounce buffers ----------------------------------------------------------------------------------


class BouncePool:
    """A free list of page-aligned buffers of ``block_bytes`` each, reused across requests.

    At most ``max_idle`` buffers are kept between uses; a burst of more concurrent users allocates more
    and frees the extra ones on release, so memory held while idle is bounded by
    ``max_idle * block_bytes``.

    Thread safety: ``acquire`` may be used from any number of threads.
    """

    def __init__(self, block_bytes: int = DEFAULT_BLOCK_BYTES, *, max_idle: int = 8) -> None:
        if block_bytes < ALIGN or block_bytes % ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {ALIGN}, got {block_bytes}")
        self.block_bytes = block_bytes
        self.max_idle = max_idle
        self._free: list[memoryview] = []
        self._lock = threading.Lock()
        self.allocated = 0

    @contextlib.contextmanager
    def acquire(self) -> Iterator[memoryview]:
        """A buffer for the duration of the ``with`` block; its content is undefined."""
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            buf = aligned_buffer(self.block_bytes)
            with self._lock:
                self.allocated += 1
        try:
            yield buf
        finally:
            with self._lock:
                if len(self._free) < self.max_idle:
                    self._free.append(buf)

    def idle_bytes(self) -> int:
        with self._lock:
            return len(self._free) * self.block_bytes


def _memmove(dst: memoryview, src: memoryview) -> None:
    # ctypes.memmove is a foreign call, so it releases the GIL: copies on other threads run in parallel.
    n = len(src)
    if n:
        ctypes.memmove(address_of(dst), address_of(src), n)


# -- direct writes -----------------------------------------------------------------------------------


def pwrite_direct(fd: int, data: memoryview, offset: int, alignment: DioAlignment, pool: BouncePool) -> bool:
    """Write ``data`` (a ``B`` view whose offset and length are multiples of ``alignment.offset``).

    Writes straight from ``data`` when its address is a multiple of ``alignment.memory``, else copies
    it block by block into a bounce buffer from ``pool`` and writes from there.

    Returns:
        True when the bytes went through bounce buffers.

    Raises:
        OSError: the write failed; :func:`is_refusal` tells whether to retry with buffered I/O (nothing
            was written then, or the bytes written are rewritten identically by the retry).
    """
    if offset % alignment.offset or len(data) % alignment.offset:
        raise ValueError(f"direct write at {offset} of {len(data)} bytes is not {alignment.offset}-aligned")
    if address_of(data) % alignment.memory == 0:
        _pwrite_all(fd, data, offset, alignment.offset)
        return False
    with pool.acquire() as buf:
        block = pool.block_bytes
        for start in range(0, len(data), block):
            piece = data[start : start + block]
            _memmove(buf, piece)
            _pwrite_all(fd, buf[: len(piece)], offset + start, alignment.offset)
    return True


def _pwrite_all(fd: int, view: memoryview, offset: int, align: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        if n % align and n != len(view):
            # A short direct write that ends off a block boundary cannot be continued with direct I/O.
            raise OSError(errno.EIO, f"short direct write of {n} bytes")
        view = view[n:]
        offset += n


class PartialBlocks:
    """Unaligned pieces of writes, merged per aligned block and written as whole blocks at the end.

    Each block starts as zeros (what a fresh file holds where nothing was written); :meth:`add` copies a
    piece into it. :meth:`runs` yields runs of consecutive blocks so that :meth:`flush_direct` writes them
    with few large system calls.

    Thread safety: :meth:`add` may be called from many threads; flushing happens once, after every
    ``add`` returned.
    """

    def __init__(self, align: int) -> None:
        self.align = align
        self._blocks: dict[int, bytearray] = {}
        self._pieces: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()

    def add(self, offset: int, data: memoryview) -> None:
        """Merge ``data`` (which may span a block boundary) into the pending blocks at ``offset``."""
        align = self.align
        with self._lock:
            self._pieces.append((offset, bytes(data)))
            pos, end = offset, offset + len(data)
            while pos < end:
                index = pos // align
                block = self._blocks.get(index)
                if block is None:
                    block = self._blocks[index] = bytearray(align)
                start = pos - index * align
                n = min(align - start, end - pos)
                block[start : start + n] = data[pos - offset : pos - offset + n]
                pos += n

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return len(self._blocks) * self.align

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def runs(self) -> Iterator[tuple[int, list[bytearray]]]:
        """``(file offset, blocks)`` for each run of consecutive pending blocks, in file order."""
        with self._lock:
            indices = sorted(self._blocks)
            blocks = dict(self._blocks)
        run: list[bytearray] = []
        first = prev = -2
        for i in indices:
            if i != prev + 1 and run:
                yield first * self.align, run
                run = []
            if not run:
                first = i
            run.append(blocks[i])
            prev = i
        if run:
            yield first * self.align, run

    def flush_direct(self, fd: int, alignment: DioAlignment, pool: BouncePool) -> int:
        """Write every pending block with direct I/O (through bounce buffers); returns bytes written."""
        total = 0
        with pool.acquire() as buf:
            for offset, blocks in self.runs():
                # Up to a bounce buffer's worth of consecutive blocks per system call.
                per_call = max(1, pool.block_bytes // self.align)
                for k in range(0, len(blocks), per_call):
                    group = blocks[k : k + per_call]
                    n = len(group) * self.align
                    for j, block in enumerate(group):
                        buf[j * self.align : (j + 1) * self.align] = block
                    _pwrite_all(fd, buf[:n], offset + k * self.align, alignment.offset)
                    total += n
        self.clear()
        return total

    def flush_buffered(self, fd: int) -> int:
        """Write the original pieces (not whole blocks) with plain ``pwrite``; returns bytes written."""
        with self._lock:
            pieces = list(self._pieces)
        total = 0
        for offset, data in pieces:
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                if n <= 0:
                    raise OSError(errno.EIO, "pwrite wrote nothing")
                view, offset, total = view[n:], offset + n, total + n
        self.clear()
        return total

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._pieces.clear()


# -- direct reads ------------------------------------------------------------------------------------


class ReadSink(Protocol):
    """Sees every byte :func:`pread_direct` fills, in file order: bounced bytes as it copies them out (the
    sink does the copy), bytes read in place after they landed."""

    def copy(self, dst: memoryview, src: memoryview) -> None:
        """Copy ``src`` (bounce buffer) into ``dst`` (the caller's memory)."""

    def landed(self, view: memoryview) -> None:
        """``view`` of the caller's memory was filled in place."""


def pread_direct(
    fd: int, out: memoryview, offset: int, alignment: DioAlignment, pool: BouncePool, sink: ReadSink | None = None
) -> tuple[int, int]:
    """Fill ``out`` (a ``B`` view) with the file's bytes at ``offset`` using direct reads.

    The aligned middle of the range is read straight into ``out`` when the address of ``out`` and the
    file offset are congruent modulo the memory alignment (so that aligned file blocks land at aligned
    addresses); otherwise, and for the unaligned head and tail, whole aligned blocks are read into a
    bounce buffer and the needed bytes copied out (by ``sink`` when given, which sees every filled byte
    in file order).

    Returns:
        ``(filled, bounced)``: bytes of ``out`` filled (less than ``len(out)`` only at end of file) and
        how many of them went through a bounce buffer.

    Raises:
        OSError: the read failed (:func:`is_refusal` tells whether to retry buffered).
    """
    length = len(out)
    if length == 0:
        return 0, 0
    align = alignment.offset
    head, middle, _tail = split_aligned(offset, length, align)
    in_place = middle > 0 and (address_of(out) + head) % alignment.memory == 0
    if not in_place:
        filled = _read_bounced(fd, out, offset, align, pool, sink)
        return filled, filled
    bounced = 0
    if head:
        got = _read_bounced(fd, out[:head], offset, align, pool, sink)
        bounced += got
        if got < head:
            return got, bounced
    got = _pread_all(fd, out[head : head + middle], offset + head, align)
    if sink is not None:
        sink.landed(out[head : head + got])
    if got < middle:
        return head + got, bounced
    rest = length - head - middle
    if rest:
        got = _read_bounced(fd, out[head + middle :], offset + head + middle, align, pool, sink)
        bounced += got
        return head + middle + got, bounced
    return length, bounced


def _read_bounced(fd: int, out: memoryview, offset: int, align: int, pool: BouncePool, sink: ReadSink | None) -> int:
    """Read ``out`` through bounce buffers: aligned blocks covering the range, then copy the bytes out."""
    length = len(out)
    filled = 0
    copy = _memmove if sink is None else sink.copy
    with pool.acquire() as buf:
        block = pool.block_bytes
        while filled < length:
            pos = offset + filled
            start = pos - pos % align  # aligned file offset of the block holding ``pos``
            skip = pos - start
            span = min(block, align_up(skip + length - filled, align))
            got = _pread_all(fd, buf[:span], start, align)
            usable = min(got - skip, length - filled)
            if usable <= 0:
                return filled
            copy(out[filled : filled + usable], buf[skip : skip + usable])
            filled += usable
            if got < span:
                return filled
    return filled


def _pread_all(fd: int, view: memoryview, offset: int, align: int) -> int:
    """Read until ``view`` is full or end of file; returns bytes read."""
    total = 0
    while total < len(view):
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
        if total < len(view) and n % align:
            # A short direct read off a block boundary is end of file; continuing would be misaligned.
            break
    return total
