"""POSIX file-system storage: local disk, /dev/shm, or a shared file system with atomic rename.

Durability follows the recipe in docs/format.md section 6: files are created with ``O_EXCL``, written,
``fsync``-ed; a whole-object ``put`` goes through a temporary file, ``fsync``, rename (or ``link`` for
create-only) and an ``fsync`` of the directory. Reads never follow a symbolic link at the last component
and refuse anything that is not a regular file.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from .._crash import crashpoint
from ..errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    ObjectNotFoundError,
    StorageError,
    storage_error_from_os,
)
from ..format.layout import new_token
from .base import ObjectInfo, PutMode, StorageCapabilities, check_key

log = logging.getLogger(__name__)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
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


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``fsync`` a directory so that entries created, renamed or removed in it are durable."""
    fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``, failing with ``FileExistsError`` if ``dst`` exists.

    Uses ``renameat2(RENAME_NOREPLACE)``. Where the kernel or file system lacks it, falls back to
    ``rename(2)``, which for directories refuses to replace a non-empty directory (and a committed
    checkpoint always holds its manifest).
    """
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), dst)
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise FileExistsError(errno.EEXIST, "File exists", dst)
    os.rename(src, dst)


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


_VOLATILE_FS = {"tmpfs", "ramfs"}
_SHARED_FS = {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "beegfs", "fuse.juicefs", "ceph", "9p"}


class LocalStorage:
    """A directory on a POSIX file system. See :mod:`tiersave.storage.base` for the protocol."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        path = Path(root).expanduser()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"checkpoint root {str(path)!r} exists and is not a directory")
        if not path.exists():
            if not create:
                raise ObjectNotFoundError(f"checkpoint root {str(path)!r} does not exist", tier=str(path))
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise storage_error_from_os(exc, tier=str(path), key="", action="creating root") from None
        self.root = path.resolve()
        self.uri = self.root.as_uri()
        self.fstype = filesystem_type(self.root)
        self.capabilities = StorageCapabilities(
            atomic_rename=True,
            conditional_put=True,
            direct_io=hasattr(os, "O_DIRECT"),
            durable=self.fstype not in _VOLATILE_FS,
            shared=self.fstype in _SHARED_FS,
        )

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r}, fstype={self.fstype!r})"

    # -- paths and errors -------------------------------------------------------------------------

    def path(self, key: str, *, allow_empty: bool = False) -> Path:
        """The file-system path of ``key``; rejects keys that could leave the root."""
        parts = check_key(key, allow_empty=allow_empty)
        return self.root.joinpath(*parts)

    @contextlib.contextmanager
    def _errors(self, action: str, key: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except OSError as exc:
            raise storage_error_from_os(exc, tier=self.uri, key=key, action=action) from None

    # -- whole objects ----------------------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        final = self.path(key)
        tmp = final.with_name(f".{final.name}.put-{new_token()}")
        with self._errors("writing", key):
            final.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
            try:
                _write_all(fd, memoryview(data), 0)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                _unlink_quiet(tmp)
                raise
            os.close(fd)
            try:
                if mode == "create":
                    os.link(tmp, final)  # fails with EEXIST instead of replacing
                    os.unlink(tmp)
                else:
                    os.replace(tmp, final)
            except FileExistsError:
                _unlink_quiet(tmp)
                raise AlreadyExistsError(
                    f"{key!r} already exists on {self.uri}; create-only write refused to replace it",
                    tier=self.uri,
                    key=key,
                ) from None
            except BaseException:
                _unlink_quiet(tmp)
                raise
            fsync_dir(final.parent)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        with self._errors("reading", key):
            fd = _open_regular(self.path(key), key)
            try:
                size = os.fstat(fd).st_size
                if max_bytes is not None and size > max_bytes:
                    raise FormatError(
                        f"{key!r} on {self.uri} is {size} bytes, over the {max_bytes}-byte limit", path=key
                    )
                out = bytearray(size)
                _read_all(fd, memoryview(out), 0, key)
                return bytes(out)
            finally:
                os.close(fd)

    # -- large objects ----------------------------------------------------------------------------

    def open_writer(self, key: str) -> LocalBlobWriter:
        path = self.path(key)
        with self._errors("creating", key):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
        return LocalBlobWriter(self, key, path, fd)

    def open_reader(self, key: str) -> LocalBlobReader:
        path = self.path(key)
        with self._errors("opening", key):
            fd = _open_regular(path, key)
        return LocalBlobReader(self, key, fd)

    # -- metadata ---------------------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        with self._errors("inspecting", key):
            st = os.stat(self.path(key), follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError(f"{key!r} on {self.uri} is not a regular file", tier=self.uri, key=key)
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        base = self.path(prefix, allow_empty=True)
        for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
            rel = os.path.relpath(dirpath, self.root)
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                try:
                    st = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while listing
                if stat.S_ISREG(st.st_mode):
                    yield ObjectInfo(key, st.st_size, st.st_mtime)
            dirnames.sort()

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        base = self.path(prefix, allow_empty=True)
        try:
            with os.scandir(base) as it:
                return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise storage_error_from_os(exc, tier=self.uri, key=prefix, action="listing") from None

    # -- deletion and rename ----------------------------------------------------------------------

    def delete(self, key: str) -> None:
        with self._errors("deleting", key):
            _unlink_quiet(self.path(key))

    def delete_prefix(self, prefix: str) -> None:
        path = self.path(prefix)
        with self._errors("deleting", prefix):
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.exists():
                shutil.rmtree(path)

    def rename_prefix(self, src: str, dst: str) -> None:
        src_path, dst_path = self.path(src), self.path(dst)
        with self._errors("renaming", f"{src} -> {dst}"):
            try:
                rename_noreplace(str(src_path), str(dst_path))
            except FileExistsError:
                raise AlreadyExistsError(
                    f"{dst!r} already exists on {self.uri}; refusing to replace it", tier=self.uri, key=dst
                ) from None
            crashpoint("after_rename")
            fsync_dir(dst_path.parent)
            if src_path.parent != dst_path.parent:
                fsync_dir(src_path.parent)

    def sync_prefix(self, prefix: str) -> None:
        """``fsync`` the directory ``prefix`` itself (its entries become durable)."""
        with self._errors("syncing", prefix):
            fsync_dir(self.path(prefix))

    def close(self) -> None:
        pass


class LocalBlobWriter:
    """Writes one file with ``pwrite`` from any number of threads."""

    def __init__(self, storage: LocalStorage, key: str, path: Path, fd: int) -> None:
        self.key = key
        self._storage = storage
        self._path = path
        self._fd: int | None = fd

    def write_at(self, offset: int, data: memoryview) -> None:
        fd = self._fd
        if fd is None:
            raise StorageError(f"{self.key!r}: write after finish/abort", tier=self._storage.uri, key=self.key)
        with self._storage._errors("writing", self.key):
            _write_all(fd, data, offset)

    def finish(self, size: int) -> None:
        fd = self._fd
        if fd is None:
            raise StorageError(f"{self.key!r}: finish after abort", tier=self._storage.uri, key=self.key)
        with self._storage._errors("syncing", self.key):
            try:
                os.ftruncate(fd, size)
                os.fsync(fd)  # an fsync error means this file is lost: never retried (fsyncgate)
            finally:
                self._fd = None
                os.close(fd)

    def abort(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        _unlink_quiet(self._path)


class LocalBlobReader:
    """Reads ranges of one regular file with ``preadv`` from any number of threads."""

    def __init__(self, storage: LocalStorage, key: str, fd: int) -> None:
        self.key = key
        self._storage = storage
        self._fd = fd
        self.size = os.fstat(fd).st_size

    def read_into(self, offset: int, out: memoryview) -> None:
        with self._storage._errors("reading", self.key):
            _read_all(self._fd, out, offset, self.key)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> LocalBlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_regular(path: Path, key: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FormatError(
                f"{key!r} is a symbolic link; tiersave never follows links in a checkpoint", path=key
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ObjectNotFoundError(f"{key!r} is not a regular file", key=key)
    return fd


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = view[n:]
        offset += n


def _read_all(fd: int, out: memoryview, offset: int, key: str) -> None:
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


def _unlink_quiet(path: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
