"""POSIX file-system storage: local disk, /dev/shm, or a shared file system with atomic rename.

Scope: :class:`LocalStorage`, the :class:`~tiersave.storage.base.Storage` protocol on a directory:
whole-object ``put``/``get``, opening blob writers and readers (with their direct-I/O twin
descriptor), listing, deletion, the atomic rename that commits a checkpoint, and what the file system
can do (``capabilities``). Anti-scope: the writers' and readers' per-request I/O
(:mod:`tiersave.storage.posix.blobs`), the rules choosing direct or buffered
(:mod:`tiersave.storage.posix.policy`), system-call helpers (:mod:`tiersave.storage.posix.files`).

Durability follows the recipe in docs/format.md section 6: files are created with ``O_EXCL``, written,
``fsync``-ed; a whole-object ``put`` goes through a temporary file, ``fsync``, rename (or ``link`` for
create-only) and an ``fsync`` of the directory.

Every key is reached from the root one component at a time without following a link
(:mod:`tiersave.storage.posix.safepath`): reading through a link is a ``FormatError``; listing and ``head``
treat what lies behind a link as absent. Reads refuse anything but a regular file before any open can block
(a FIFO in place of a shard). A root that another user can write is refused when it is opened
(:mod:`tiersave.storage.posix.trust`).

Shard writers and readers choose direct or buffered I/O per request (``io=`` option, ``TIERSAVE_IO``;
rules in :mod:`tiersave.storage.posix.policy`, mechanics in :mod:`tiersave.storage.posix.directio`). A
writer opens the new file once buffered (``O_EXCL``) and once more with ``O_DIRECT``; a file system that
refuses ``O_DIRECT`` gets buffered I/O, never an error. O_DIRECT is not durability: ``finish`` always
``fsync``-s. Whole objects (``put``/``get``: manifests) are small and always buffered.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
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
    os_errors,
    read_all,
    rename_noreplace,
    unlink_quiet,
    write_all,
)
from .lock import FileWriterLock
from .policy import IOMode, IOPolicy, IOStats, bounce_bytes, direct_min_bytes, io_mode_from_env, parse_io_mode
from .safepath import DirWalk, clear_nonblock, open_regular_at, remove_tree_at
from .trust import check_root

__all__ = ["LocalStorage"]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
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
        with os_errors(self.uri, "opening root", ""):
            check_root(self.root)
            self._dirs = DirWalk(self.root, self.uri)
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

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite", durable: bool = True) -> None:
        """As :meth:`Storage.put`; ``durable=False`` skips the fsyncs, for records that need not outlive the
        machine (read leases, whose reader a power loss ends too): still atomic, visible at once."""
        parts = check_key(key)
        name = parts[-1]
        tmp = f".{name}.put-{new_token()}"
        with os_errors(self.uri, "writing", key), self._dirs.parent(parts, key, create=True) as dfd:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | _O_NOFOLLOW, 0o644, dir_fd=dfd)
            try:
                write_all(fd, memoryview(data), 0)
                if durable:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                unlink_quiet(tmp, dir_fd=dfd)
                raise
            os.close(fd)
            try:
                if mode == "create":
                    # fails with EEXIST instead of replacing
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                    # written: a removal of this directory's contents (a lease folder's) may have taken tmp already
                    unlink_quiet(tmp, dir_fd=dfd)
                else:
                    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except FileExistsError:
                unlink_quiet(tmp, dir_fd=dfd)
                raise AlreadyExistsError(
                    f"{key!r} already exists on {self.uri}; create-only write refused to replace it",
                    tier=self.uri,
                    key=key,
                ) from None
            except BaseException:
                unlink_quiet(tmp, dir_fd=dfd)
                raise
            if durable:
                fsync_dir(dfd)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        parts = check_key(key)
        with os_errors(self.uri, "reading", key), self._dirs.parent(parts, key) as dfd:
            fd = open_regular_at(dfd, parts[-1], key)
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

    def open_writer(self, key: str, *, size_hint: int | None = None) -> LocalBlobWriter:
        """Create ``key`` (``O_EXCL``) for writing; ``size_hint`` bounds the preallocation (see the protocol)."""
        parts = check_key(key)
        name = parts[-1]
        if size_hint is not None and (isinstance(size_hint, bool) or not isinstance(size_hint, int) or size_hint < 0):
            raise ConfigError(f"size_hint must be a non-negative integer or None, got {size_hint!r}")
        with os_errors(self.uri, "creating", key), self._dirs.parent(parts, key, create=True) as dirfd:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | _O_NOFOLLOW, 0o644, dir_fd=dirfd)
            try:
                dfd = self._open_direct_twin(dirfd, name, key, fd, os.O_WRONLY)
            except BaseException:
                os.close(fd)
                unlink_quiet(name, dir_fd=dirfd)
                raise
        return LocalBlobWriter(self, key, fd, dfd, discard=functools.partial(self.delete, key), size_hint=size_hint)

    def open_reader(self, key: str) -> LocalBlobReader:
        return self._open_reader(key, direct=True)

    def open_shared_reader(self, key: str) -> LocalBlobReader:
        """A reader of a file that several processes of this machine read at about the same time (the
        replicated state every rank of a node restores): buffered whatever the I/O policy, so the page cache
        reads its bytes from the device once for all of them, where direct reads would read them once each."""
        return self._open_reader(key, direct=False)

    def _open_reader(self, key: str, *, direct: bool) -> LocalBlobReader:
        parts = check_key(key)
        with os_errors(self.uri, "opening", key), self._dirs.parent(parts, key) as dirfd:
            fd = open_regular_at(dirfd, parts[-1], key)
            try:
                dfd = self._open_direct_twin(dirfd, parts[-1], key, fd, os.O_RDONLY) if direct else None
            except BaseException:
                os.close(fd)
                raise
        return LocalBlobReader(self, key, fd, dfd)

    def _open_direct_twin(self, dirfd: int, name: str, key: str, fd: int, flags: int) -> int | None:
        """A second, O_DIRECT descriptor of the file open as ``fd``; None when direct I/O is off or refused.

        The name is opened again in the same directory, without following a link and without blocking, and
        must name the same inode, so a file (or a FIFO) swapped in between the two opens is never used.
        """
        if not self.io_policy.wants_direct():
            return None
        dfd = open_direct(name, flags | _O_NONBLOCK, dir_fd=dirfd)
        if dfd is None:
            self.io_policy.mark_refused("EINVAL on open(O_DIRECT)")
            return None
        a, b = os.fstat(fd), os.fstat(dfd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(dfd)
            raise FormatError(f"{key!r} on {self.uri} was replaced while it was being opened", path=key)
        clear_nonblock(dfd)
        return dfd

    # -- metadata ---------------------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        parts = check_key(key)
        try:
            with os_errors(self.uri, "inspecting", key), self._dirs.parent(parts, key) as dfd:
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        except FormatError:  # a link on the way: nothing reached through it belongs to this storage
            raise ObjectNotFoundError(
                f"{key!r} on {self.uri} lies behind a symbolic link (never followed)", tier=self.uri, key=key
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError(f"{key!r} on {self.uri} is not a regular file", tier=self.uri, key=key)
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    def _open_prefix(self, prefix: str) -> int | None:
        """A descriptor of the directory ``prefix``; None when it is missing, not a directory, or a link
        (listing never follows one: what lies behind it is not part of this storage)."""
        parts = check_key(prefix, allow_empty=True)
        try:
            with os_errors(self.uri, "listing", prefix):
                return self._dirs.open_dirs(parts, prefix)
        except (ObjectNotFoundError, FormatError):
            return None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        top = self._open_prefix(prefix)
        if top is None:
            return
        try:
            # fwalk descends through directory descriptors and never into a link, even one swapped in mid-walk
            for dirpath, dirnames, filenames, dirfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
                rel = "/".join(p for p in (prefix, dirpath[2:]) if p)
                for name in filenames:
                    try:
                        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed while listing
                    if stat.S_ISREG(st.st_mode):
                        yield ObjectInfo(f"{rel}/{name}" if rel else name, st.st_size, st.st_mtime)
                dirnames.sort()
        except OSError as exc:
            raise storage_error_from_os(exc, tier=self.uri, key=prefix, action="listing") from None
        finally:
            os.close(top)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        top = self._open_prefix(prefix)
        if top is None:
            return []
        try:
            with os.scandir(top) as it:
                return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
        except OSError as exc:
            raise storage_error_from_os(exc, tier=self.uri, key=prefix, action="listing") from None
        finally:
            os.close(top)

    # -- deletion and rename ----------------------------------------------------------------------

    def delete(self, key: str) -> None:
        parts = check_key(key)
        try:
            with os_errors(self.uri, "deleting", key), self._dirs.parent(parts, key) as dfd:
                unlink_quiet(parts[-1], dir_fd=dfd)  # a link itself is removed, never followed
        except ObjectNotFoundError:
            return  # its directory is missing: so is the object

    def delete_prefix(self, prefix: str) -> None:
        parts = check_key(prefix)
        try:
            with os_errors(self.uri, "deleting", prefix), self._dirs.parent(parts, prefix) as dfd:
                try:
                    mode = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    return
                if stat.S_ISDIR(mode):
                    remove_tree_at(dfd, parts[-1])
                else:
                    os.unlink(parts[-1], dir_fd=dfd)
        except ObjectNotFoundError:
            return

    def rename_prefix(self, src: str, dst: str) -> None:
        src_parts, dst_parts = check_key(src), check_key(dst)
        with (
            os_errors(self.uri, "renaming", f"{src} -> {dst}"),
            self._dirs.parent(src_parts, src) as src_dir,
            self._dirs.parent(dst_parts, dst) as dst_dir,
        ):
            try:
                rename_noreplace(src_parts[-1], dst_parts[-1], src_dir_fd=src_dir, dst_dir_fd=dst_dir)
            except FileExistsError:
                raise AlreadyExistsError(
                    f"{dst!r} already exists on {self.uri}; refusing to replace it", tier=self.uri, key=dst
                ) from None
            crashpoint("after_rename")
            try:
                fsync_dir(dst_dir)
                if src_parts[:-1] != dst_parts[:-1]:
                    fsync_dir(src_dir)
            except OSError:
                # The rename may not be durable and a failed fsync is never retried (fsyncgate): undo it, so
                # that a failed commit (or un-commit) leaves the names as they were, then report the error.
                with contextlib.suppress(OSError):
                    rename_noreplace(dst_parts[-1], src_parts[-1], src_dir_fd=dst_dir, dst_dir_fd=src_dir)
                raise

    def sync_prefix(self, prefix: str) -> None:
        """``fsync`` the directory ``prefix`` itself (its entries become durable)."""
        with os_errors(self.uri, "syncing", prefix):
            fd = self._dirs.open_dirs(check_key(prefix), prefix)
            try:
                fsync_dir(fd)
            finally:
                os.close(fd)

    def writer_lock(self) -> FileWriterLock:
        """Take this root's writer lock (``flock`` on ``tiersave-writer.lock``; :mod:`tiersave.storage.lock`).

        Raises:
            WriterLockedError: another live writer holds it, named in the message.
        """
        return FileWriterLock(self._dirs, self.uri)

    def close(self) -> None:
        pass
