"""POSIX file-system storage: local disk, /dev/shm, or a shared file system with atomic rename.

Scope: :class:`LocalStorage`, the :class:`~tiersave.storage.base.Storage` protocol on a directory:
whole-object ``put``/``get``, opening blob writers and readers (with their direct-I/O twin
descriptor), listing, deletion, the atomic rename that commits a checkpoint, and what the file system
can do (``capabilities``). Anti-scope: the writers' and readers' per-request I/O
(:mod:`tiersave.storage.posix.blobs`), the rules choosing direct or buffered
(:mod:`tiersave.storage.posix.policy`), system-call helpers (:mod:`tiersave.storage.posix.files`).

Durability follows the recipe in docs/format.md section 6: files are created with ``O_EXCL``, written,
``fsync``-ed; a whole-object ``put`` goes through a temporary file, ``fsync``, rename (or ``link`` for
create-only) and an ``fsync`` of the directory. Reads never follow a symbolic link at the last component
and refuse anything that is not a regular file.

Shard writers and readers choose direct or buffered I/O per request (``io=`` option, ``TIERSAVE_IO``;
rules in :mod:`tiersave.storage.posix.policy`, mechanics in :mod:`tiersave.storage.posix.directio`). A
writer opens the new file once buffered (``O_EXCL``) and once more with ``O_DIRECT``; a file system that
refuses ``O_DIRECT`` gets buffered I/O, never an error. O_DIRECT is not durability: ``finish`` always
``fsync``-s. Whole objects (``put``/``get``: manifests) are small and always buffered.
"""

from __future__ import annotations

import builtins
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from ..._crash import crashpoint
from ...errors import (
    AlreadyExistsError,
    ConfigError,
    FormatError,
    ObjectNotFoundError,
    storage_error_from_os,
)
from ...format.layout import new_token
from ..base import ObjectInfo, PutMode, StorageCapabilities, check_key
from .blobs import LocalBlobReader, LocalBlobWriter
from .calibration import Calibration
from .directio import BouncePool, open_direct
from .files import (
    O_CLOEXEC,
    filesystem_type,
    fsync_dir,
    open_regular,
    os_errors,
    read_all,
    rename_noreplace,
    unlink_quiet,
    write_all,
)
from .policy import IOMode, IOPolicy, IOStats, bounce_bytes, direct_min_bytes, io_mode_from_env, parse_io_mode

__all__ = ["LocalStorage"]

_VOLATILE_FS = {"tmpfs", "ramfs"}
_NO_DIRECT_FS = {"ramfs"}  # known to refuse O_DIRECT on open; others are found out by trying
_SHARED_FS = {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "beegfs", "fuse.juicefs", "ceph", "9p"}


class LocalStorage:
    """A directory on a POSIX file system. See :mod:`tiersave.storage.base` for the protocol.

    Args:
        root: the directory (created if missing and ``create``).
        create: create a missing root (False: raise ``ObjectNotFoundError``).
        io: ``"auto"`` (per request, see :mod:`tiersave.storage.posix.policy`), ``"direct"`` or
            ``"buffered"``; None reads ``TIERSAVE_IO`` (default auto). Auto is buffered on tmpfs/ramfs.
        min_direct_bytes: auto sends smaller requests buffered (default ``TIERSAVE_DIRECT_MIN_BYTES``).
        calibration: a fixed :class:`~tiersave.storage.posix.calibration.Calibration` for auto (None:
            measured once per file system and cached).

    Attributes:
        io_policy: the per-request policy.
        io_stats: bytes, seconds and decisions of every writer and reader of this storage so far
            (each writer or reader adds its own ``io_stats`` when it finishes or closes).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        create: bool = True,
        io: IOMode | str | None = None,
        min_direct_bytes: int | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        mode = parse_io_mode(io) if io is not None else io_mode_from_env()
        if min_direct_bytes is not None and (not isinstance(min_direct_bytes, int) or min_direct_bytes < 0):
            raise ConfigError(f"min_direct_bytes must be a non-negative integer, got {min_direct_bytes!r}")
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
            direct_io=hasattr(os, "O_DIRECT") and self.fstype not in _NO_DIRECT_FS,
            durable=self.fstype not in _VOLATILE_FS,
            shared=self.fstype in _SHARED_FS,
        )
        self.io_policy = IOPolicy(
            mode,
            self.root,
            self.fstype,
            min_direct_bytes=min_direct_bytes if min_direct_bytes is not None else direct_min_bytes(),
            calibration=calibration,
        )
        if self.fstype in _NO_DIRECT_FS:
            self.io_policy.mark_refused(f"{self.fstype} has no O_DIRECT")
        self.bounce_pool = BouncePool(bounce_bytes())
        self.io_stats = IOStats()

    @property
    def io_mode(self) -> IOMode:
        return self.io_policy.mode

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r}, fstype={self.fstype!r}, io={self.io_policy.mode.value!r})"

    # -- paths and errors -------------------------------------------------------------------------

    def path(self, key: str, *, allow_empty: bool = False) -> Path:
        """The file-system path of ``key``; rejects keys that could leave the root."""
        parts = check_key(key, allow_empty=allow_empty)
        return self.root.joinpath(*parts)

    # -- whole objects ----------------------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        final = self.path(key)
        tmp = final.with_name(f".{final.name}.put-{new_token()}")
        with os_errors(self.uri, "writing", key):
            final.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o644)
            try:
                write_all(fd, memoryview(data), 0)
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                unlink_quiet(tmp)
                raise
            os.close(fd)
            try:
                if mode == "create":
                    os.link(tmp, final)  # fails with EEXIST instead of replacing
                    os.unlink(tmp)
                else:
                    os.replace(tmp, final)
            except FileExistsError:
                unlink_quiet(tmp)
                raise AlreadyExistsError(
                    f"{key!r} already exists on {self.uri}; create-only write refused to replace it",
                    tier=self.uri,
                    key=key,
                ) from None
            except BaseException:
                unlink_quiet(tmp)
                raise
            fsync_dir(final.parent)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        with os_errors(self.uri, "reading", key):
            fd = open_regular(self.path(key), key)
            try:
                size = os.fstat(fd).st_size
                if max_bytes is not None and size > max_bytes:
                    raise FormatError(
                        f"{key!r} on {self.uri} is {size} bytes, over the {max_bytes}-byte limit", path=key
                    )
                out = bytearray(size)
                read_all(fd, memoryview(out), 0, key)
                return bytes(out)
            finally:
                os.close(fd)

    # -- large objects ----------------------------------------------------------------------------

    def open_writer(self, key: str) -> LocalBlobWriter:
        path = self.path(key)
        with os_errors(self.uri, "creating", key):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o644)
            try:
                dfd = self._open_direct_twin(path, fd, os.O_WRONLY)
            except BaseException:
                os.close(fd)
                unlink_quiet(path)
                raise
        return LocalBlobWriter(self, key, path, fd, dfd)

    def open_reader(self, key: str) -> LocalBlobReader:
        path = self.path(key)
        with os_errors(self.uri, "opening", key):
            fd = open_regular(path, key)
            try:
                dfd = self._open_direct_twin(path, fd, os.O_RDONLY)
            except BaseException:
                os.close(fd)
                raise
        return LocalBlobReader(self, key, fd, dfd)

    def _open_direct_twin(self, path: Path, fd: int, flags: int) -> int | None:
        """A second, O_DIRECT descriptor of the file open as ``fd``; None when direct I/O is off or refused.

        The path is opened again without following links and must name the same inode, so a file swapped
        in between the two opens is never used.
        """
        if not self.io_policy.wants_direct():
            return None
        dfd = open_direct(path, flags)
        if dfd is None:
            self.io_policy.mark_refused("EINVAL on open(O_DIRECT)")
            return None
        a, b = os.fstat(fd), os.fstat(dfd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(dfd)
            raise FormatError(f"{path} was replaced while it was being opened", path=str(path))
        return dfd

    # -- metadata ---------------------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        with os_errors(self.uri, "inspecting", key):
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
        with os_errors(self.uri, "deleting", key):
            unlink_quiet(self.path(key))

    def delete_prefix(self, prefix: str) -> None:
        path = self.path(prefix)
        with os_errors(self.uri, "deleting", prefix):
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.exists():
                shutil.rmtree(path)

    def rename_prefix(self, src: str, dst: str) -> None:
        src_path, dst_path = self.path(src), self.path(dst)
        with os_errors(self.uri, "renaming", f"{src} -> {dst}"):
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
        with os_errors(self.uri, "syncing", prefix):
            fsync_dir(self.path(prefix))

    def close(self) -> None:
        pass
