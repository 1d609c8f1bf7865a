"""Early writeback of buffered writes: the disk starts writing each range soon after it is written.

A buffered ``write`` only copies bytes into the page cache, and the ``fsync`` at the end of a file then makes
the disk write all of it at once: the copy and the disk's work run one after the other. Here every writer
thread that has written ``TIERSAVE_WRITEBACK_BYTES`` (16 MiB) of consecutive bytes to a file asks the kernel
to start writing them out (``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)``, which queues the I/O
and returns), so the disk works while the next ranges are copied and the final ``fsync`` finds little left
(docs/benchmarks.md, "The buffered save, 2026-11-24").

Durability is unchanged: ``sync_file_range`` promises nothing (no metadata, no flush of the disk's cache) and the
writer's final ``fsync`` stays exactly as it was. Only ``SYNC_FILE_RANGE_WRITE`` is used, never the flags that
wait: a wait reports and *consumes* the file's writeback error (the kernel advances the file's error cursor),
so a later ``fsync`` of the same file would no longer see it. An error this call returns (EIO, ENOSPC) is
raised: the save fails there rather than at its ``fsync``. Where the call does not exist (not Linux, no such
symbol) or is refused (ENOSYS, EINVAL, ESPIPE, EOPNOTSUPP), the writer goes on without it: the final
``fsync`` then writes everything, as before.

Scope: the ``sync_file_range`` binding, the per-thread runs of consecutive writes to one file and when to start
their writeback. Anti-scope: writing the bytes and the final ``fsync`` (:mod:`~tiersave.storage.posix.blobs`),
which writes are buffered (:mod:`~tiersave.storage.posix.policy`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from ...knobs import int_env
from .policy import IOStats

log = logging.getLogger(__name__)

__all__ = ["Writeback", "sync_range", "writeback_bytes"]

SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writing the range's dirty pages, do not wait

_WRITEBACK = "TIERSAVE_WRITEBACK_BYTES"
_DEFAULT_BYTES = 16 << 20

# Answers that mean "not here" (kernel, file system or descriptor without it), never a lost write.
_UNSUPPORTED = frozenset({errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP, errno.ENOTSUP})


def writeback_bytes() -> int:
    """Bytes of consecutive writes per thread and file after which their writeback starts
    (``TIERSAVE_WRITEBACK_BYTES``, default 16 MiB; 0 turns early writeback off)."""
    return int_env(_WRITEBACK, _DEFAULT_BYTES, 0, 1 << 40)


def _load() -> Callable[[int, int, int, int], int] | None:
    """``sync_file_range`` from the C library as ``call(fd, offset, nbytes, flags) -> errno`` (0 on success),
    or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]  # off64_t in glibc and musl
    fn.restype = ctypes.c_int

    def call(fd: int, offset: int, nbytes: int, flags: int) -> int:
        return 0 if fn(fd, offset, nbytes, flags) == 0 else ctypes.get_errno()  # ctypes drops the GIL meanwhile

    return call


sync_range = _load()
"""The binding, or None on a platform without ``sync_file_range`` (tests set it to None to play one)."""


class Writeback:
    """Starts the writeback of each run of consecutive buffered writes one thread makes to one file.

    Each thread's writes are followed separately (two writer threads fill two halves of a file): a write that
    continues the thread's run extends it; once the run holds ``step`` bytes its writeback starts and a new
    run begins where it ended. A write elsewhere begins a new run; what the old one held is left to the
    kernel's own writeback and the final ``fsync``.

    Args:
        fd: the file, open for writing.
        key: the file's key, for the log.
        stats: where the ranges started are counted (``IOStats.writeback``).
        step: see :func:`writeback_bytes` (0: off).

    Thread safety: :meth:`wrote` may be called from many threads at once.
    """

    def __init__(self, fd: int, key: str, stats: IOStats, step: int | None = None) -> None:
        self._fd = fd
        self._key = key
        self._stats = stats
        self.step = writeback_bytes() if step is None else step
        self.enabled = self.step > 0 and sync_range is not None
        self._runs = threading.local()

    def wrote(self, offset: int, nbytes: int) -> None:
        """Note that this thread wrote ``nbytes`` at ``offset``; start its run's writeback once it is long enough.

        Raises:
            OSError: the kernel refused to start the writeback for another reason than not supporting it
                (an I/O error, no space): the file's bytes may not all reach the disk.
        """
        if not self.enabled:
            return
        runs = self._runs
        start, end = getattr(runs, "span", (offset, offset))
        if offset != end:
            start = offset
        end = offset + nbytes
        if end - start >= self.step:
            self._start(start, end - start)
            start = end
        runs.span = (start, end)

    def _start(self, offset: int, nbytes: int) -> None:
        call = sync_range
        assert call is not None  # enabled only where the call exists (__init__)
        t0 = time.perf_counter()
        err = call(self._fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)
        if err in _UNSUPPORTED:
            self.enabled = False  # the final fsync writes everything, as without early writeback
            log.debug("%s: no early writeback (%s)", self._key, os.strerror(err))
            return
        if err:
            raise OSError(err, f"starting the writeback of {nbytes} B at {offset}: {os.strerror(err)}")
        self._stats.record_writeback(nbytes, time.perf_counter() - t0)
