"""POSIX file-system storage: local disk, /dev/shm, or a shared file system with atomic rename.

Durability follows the recipe in docs/format.md section 6: files are created with ``O_EXCL``, written,
``fsync``-ed; a whole-object ``put`` goes through a temporary file, ``fsync``, rename (or ``link`` for
create-only) and an ``fsync`` of the directory. Reads never follow a symbolic link at the last component
and refuse anything that is not a regular file.

Shard writers and readers choose direct or buffered I/O per request (``io=`` option, ``TIERSAVE_IO``;
rules in :mod:`tiersave.storage.posix.policy`, mechanics in :mod:`tiersave.storage.posix.directio`). A writer opens
the new file once buffered (``O_EXCL``) and once more with ``O_DIRECT``; a file system that refuses
``O_DIRECT`` gets buffered I/O, never an error. O_DIRECT is not durability: ``finish`` always
``fsync``-s. Whole objects (``put``/``get``: manifests) are small and always buffered.
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
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ..._crash import crashpoint
from ...errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    ObjectNotFoundError,
    StorageError,
    storage_error_from_os,
)
from ...format.layout import new_token
from ..base import ObjectInfo, PutMode, StorageCapabilities, check_key
from .buffers import address_of
from .calibration import Calibration
from .directio import (
    BouncePool,
    DioAlignment,
    PartialBlocks,
    dio_alignment,
    is_refusal,
    open_direct,
    pread_direct,
    preallocate,
    pwrite_direct,
    split_aligned,
)
from .policy import (
    Decision,
    IOMode,
    IOPolicy,
    IOStats,
    bounce_bytes,
    direct_min_bytes,
    io_mode_from_env,
    parse_io_mode,
)

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
_NO_DIRECT_FS = {"ramfs"}  # known to refuse O_DIRECT on open; others are found out by trying
_SHARED_FS = {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "beegfs", "fuse.juicefs", "ceph", "9p"}


class LocalStorage:
    """A directory on a POSIX file system. See :mod:`tiersave.storage.base` for the protocol.

    Args:
        root: the directory (created if missing and ``create``).
        create: create a missing root (False: raise ``ObjectNotFoundError``).
        io: ``"auto"`` (per request, see :mod:`tiersave.storage.posix.policy`), ``"direct"`` or ``"buffered"``;
            None reads ``TIERSAVE_IO`` (default auto). Auto is buffered on tmpfs/ramfs.
        min_direct_bytes: auto sends smaller requests buffered (default ``TIERSAVE_DIRECT_MIN_BYTES``).
        calibration: a fixed :class:`~tiersave.storage.posix.policy.Calibration` for auto (None: measured once
            per file system and cached).

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
            try:
                dfd = self._open_direct_twin(path, fd, os.O_WRONLY)
            except BaseException:
                os.close(fd)
                _unlink_quiet(path)
                raise
        return LocalBlobWriter(self, key, path, fd, dfd)

    def open_reader(self, key: str) -> LocalBlobReader:
        path = self.path(key)
        with self._errors("opening", key):
            fd = _open_regular(path, key)
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
    """Writes one new file from any number of threads, direct or buffered per request.

    Each ``write_at`` splits its range at the file's direct-I/O block size: whole blocks go direct (in
    place when the source address allows, else through a bounce buffer) or buffered as the policy
    decides; the unaligned edges are merged into zero-filled blocks written at ``finish`` (see
    :class:`~tiersave.storage.posix.directio.PartialBlocks` for why that gives the same bytes). Once more than
    ``_MAX_PENDING_BYTES`` of edges are pending, they and every later edge go buffered instead, which keeps
    memory bounded for writers that send many tiny pieces.

    Attributes:
        io_stats: what this writer moved on each path (thread-safe).
    """

    def __init__(self, storage: LocalStorage, key: str, path: Path, fd: int, dfd: int | None = None) -> None:
        self.key = key
        self._storage = storage
        self._path = path
        self._fd: int | None = fd
        self._dfd = dfd
        self.io_stats = IOStats()
        self._align: DioAlignment = dio_alignment(dfd) if dfd is not None else DioAlignment(4096, 4096)
        self._edges = PartialBlocks(self._align.offset) if dfd is not None else None
        self._edges_buffered = False
        self._lock = threading.Lock()
        self._reserved = 0  # bytes preallocated from the start of the file (see _reserve)
        self._prealloc = dfd is not None

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
        with self._storage._errors("writing", self.key):
            if self._edges is None:  # no direct descriptor: say why in the statistics, write buffered
                self.io_stats.note(self._storage.io_policy.decide("write", n, aligned=False).reason)
                start = time.perf_counter()
                _write_all(fd, view, offset)
                self.io_stats.record("buffered", n, time.perf_counter() - start)
                return
            head, middle, tail = split_aligned(offset, n, self._align.offset)
            if head:
                self._add_edge(fd, offset, view[:head])
            if tail:
                self._add_edge(fd, offset + n - tail, view[n - tail :])
            if middle:
                self._write_blocks(fd, offset + head, view[head : head + middle])

    def _reserve(self, dfd: int, end: int) -> None:
        """Preallocate the file up to at least ``end`` so that direct writes are in-place overwrites.

        The file grows in steps of at least ``_PREALLOC_STEP_BYTES`` (or an eighth of its size), since the
        final size is known only at ``finish``, which trims the excess.
        """
        if not self._prealloc or end <= self._reserved:
            return
        with self._lock:
            if not self._prealloc or end <= self._reserved:
                return
            target = max(end, self._reserved + max(_PREALLOC_STEP_BYTES, self._reserved // 8))
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
        _write_all(fd, view, offset)
        self.io_stats.record("buffered", len(view), time.perf_counter() - start)

    def _add_edge(self, fd: int, offset: int, piece: memoryview) -> None:
        edges = self._edges
        if edges is None:
            _write_all(fd, piece, offset)
            return
        start = time.perf_counter()
        with self._lock:
            if self._edges_buffered:
                _write_all(fd, piece, offset)
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
        with self._storage._errors("syncing", self.key):
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
        _unlink_quiet(self._path)


class LocalBlobReader:
    """Reads ranges of one regular file from any number of threads, direct or buffered per request.

    Attributes:
        io_stats: what this reader moved on each path (thread-safe).
    """

    def __init__(self, storage: LocalStorage, key: str, fd: int, dfd: int | None = None) -> None:
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
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        n = len(view)
        if n == 0:
            return
        with self._storage._errors("reading", self.key):
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
                        filled, bounced = pread_direct(dfd, view, offset, self._align, self._storage.bounce_pool)
                    except OSError as exc:
                        if not is_refusal(exc):
                            raise
                        policy.mark_refused(f"{exc.strerror} on a direct read")
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
            _read_all(self._fd, view, offset, self.key)
            self.io_stats.record("buffered", n, time.perf_counter() - start)

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


_MAX_PENDING_BYTES = 64 << 20
_PREALLOC_STEP_BYTES = 256 << 20


def _describe(decision: Decision) -> tuple[str, str, str]:
    return decision.path, decision.reason, decision.detail


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
