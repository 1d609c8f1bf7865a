"""File helpers of the POSIX backend: durable renames and directory syncs, whole reads and writes, mounts.

Scope: the small system-call wrappers that :class:`~tiersave.storage.posix.LocalStorage` and its blob
writers and readers share: ``fsync`` of a directory, rename without replacing
(``renameat2(RENAME_NOREPLACE)``), the file-system type of a path, ``pwrite``/``pread`` loops, and the
mapping of ``OSError`` to tiersave's typed storage errors. Anti-scope: direct I/O
(:mod:`tiersave.storage.posix.directio`), the choice of path (:mod:`tiersave.storage.posix.policy`), keys
and the storage protocol (:mod:`tiersave.storage.base`), walking keys safely (``safepath``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterator, Sequence

from ...errors import CorruptCheckpointError, StorageError, storage_error_from_os

__all__ = [
    "O_CLOEXEC",
    "filesystem_type",
    "fsync_dir",
    "os_errors",
    "read_all",
    "rename_noreplace",
    "unlink_quiet",
    "write_all",
]

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _load_renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def fsync_dir(path: str | os.PathLike[str] | int) -> None:
    """``fsync`` a directory (a path, or a descriptor) so that entries created, renamed or removed in it are
    durable."""
    if isinstance(path, int):
        os.fsync(path)
        return
    fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_noreplace(src: str, dst: str, *, src_dir_fd: int = _AT_FDCWD, dst_dir_fd: int = _AT_FDCWD) -> None:
    """Rename ``src`` to ``dst``, failing with ``FileExistsError`` if ``dst`` exists.

    Names are relative to ``src_dir_fd``/``dst_dir_fd`` when given (``renameat2``), so a caller that reached
    those directories without following links renames exactly there.

    Uses ``renameat2(RENAME_NOREPLACE)``. Where the kernel or file system lacks it, falls back to
    ``rename(2)``, which for directories refuses to replace a non-empty directory (and a committed
    checkpoint always holds its manifest).
    """
    if _renameat2 is not None:
        rc = _renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), dst)
    src_fd = None if src_dir_fd == _AT_FDCWD else src_dir_fd
    dst_fd = None if dst_dir_fd == _AT_FDCWD else dst_dir_fd
    try:
        existing = os.stat(dst, dir_fd=dst_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISDIR(existing):
        raise FileExistsError(errno.EEXIST, "File exists", dst)
    os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The file-system type (``ext4``, ``tmpfs``, ...) of the mount holding ``path``, or ``""``."""
    target = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount = fields[4].replace("\\040", " ")
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, fstype = mount, right.split()[0]
    except OSError:
        return ""
    return fstype


@contextlib.contextmanager
def os_errors(tier: str, action: str, key: str) -> Iterator[None]:
    """Re-raise an ``OSError`` inside the block as the typed storage error naming ``tier`` and ``key``."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise storage_error_from_os(exc, tier=tier, key=key, action=action) from None


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (buffered), looping over short writes."""
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = view[n:]
        offset += n


_IOV_MAX = 1024  # Linux's limit on the pieces of one pwritev


def writev_all(fd: int, pieces: Sequence[memoryview], offset: int) -> None:
    """``pwritev`` the concatenation of ``pieces`` (byte views) at ``offset`` (buffered): one system call per
    ``_IOV_MAX`` pieces, looping over short writes."""
    views = [p for p in pieces if len(p)]
    first = 0
    while first < len(views):
        n = os.pwritev(fd, views[first : first + _IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while n:  # skip what was written; a piece written in part keeps its rest
            if n >= len(views[first]):
                n -= len(views[first])
                first += 1
            else:
                views[first] = views[first][n:]
                n = 0


def read_all(fd: int, out: memoryview, offset: int, key: str) -> None:
    """Fill ``out`` from ``offset`` (buffered), looping over short reads.

    Raises:
        CorruptCheckpointError: the file ends before ``out`` is full (names ``key``).
    """
    view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
    start = offset
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise CorruptCheckpointError(
                f"{key!r} ends before byte {start + len(out)} (read stopped at {offset})", file=key
            )
        view = view[n:]
        offset += n


def unlink_quiet(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> None:
    """Remove a file (relative to ``dir_fd`` when given); one that is already gone is not an error."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path, dir_fd=dir_fd)
