"""Opening what a key names under a storage root without ever leaving the root or blocking.

Scope: walking a key's directories from a descriptor of the root, one component at a time with
``O_NOFOLLOW`` (``openat``), so that a symbolic link at any depth, not only the last component, is refused
instead of followed; checking that the root is still the directory the storage was opened on; opening a
file for reading with ``O_NONBLOCK`` and checking ``S_ISREG`` on the open descriptor *before* anything can
block (a FIFO in place of a shard would otherwise hang ``open`` for ever), then clearing ``O_NONBLOCK``.
Anti-scope: key syntax (:func:`tiersave.storage.base.check_key`), which roots are trusted
(:mod:`tiersave.storage.posix.trust`), mapping other ``OSError``s (the caller's ``os_errors``).

Cost: a few ``openat``/``fstat`` calls per opened object, once per shard, never per request.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator, Sequence

from ...errors import FormatError, ObjectNotFoundError, StorageError

__all__ = ["DirWalk", "clear_nonblock", "describe_mode", "open_regular_at", "refuse_link", "remove_tree_at"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_NOCTTY = getattr(os, "O_NOCTTY", 0)
DIR_FLAGS = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK
READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK | _O_NOCTTY

_LINK_RULE = "tiersave never follows links in a checkpoint"


def describe_mode(mode: int) -> str:
    """A word for a file type, for messages (``"a FIFO (named pipe)"``)."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def refuse_link(key: str, component: str) -> FormatError:
    """The error for a symbolic link met at ``component`` (a prefix of ``key``)."""
    if component == key:
        return FormatError(f"{key!r} is a symbolic link; {_LINK_RULE}", path=key)
    return FormatError(f"{key!r}: directory {component!r} is a symbolic link; {_LINK_RULE}", path=key)


def clear_nonblock(fd: int) -> None:
    """Clear ``O_NONBLOCK`` (kept only for the open itself), leaving the other status flags (``O_DIRECT``)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & _O_NONBLOCK:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_O_NONBLOCK)


def open_regular_at(dir_fd: int, name: str, key: str, flags: int = READ_FLAGS) -> int:
    """Open ``name`` in ``dir_fd`` for reading: never through a link, never blocking, regular files only.

    The open carries ``O_NONBLOCK`` so that a FIFO or a device cannot block it; the type is checked on the
    open descriptor (no window between check and use), and ``O_NONBLOCK`` is cleared before returning.

    Raises:
        FormatError: ``name`` is a symbolic link, a FIFO, a socket or a device file.
        ObjectNotFoundError: ``name`` is a directory (no object there).
        OSError: any other failure to open (the caller maps it).
    """
    try:
        fd = os.open(name, flags | _O_NONBLOCK | _O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise refuse_link(key, key) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ObjectNotFoundError(f"{key!r} is a directory, not a regular file", key=key)
        if not stat.S_ISREG(mode):
            raise FormatError(
                f"{key!r} is {describe_mode(mode)}, not a regular file; tiersave reads regular files only", path=key
            )
        clear_nonblock(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Remove the directory ``name`` of ``dir_fd`` and everything in it, through descriptors only: a link
    inside is removed, never followed (``shutil.rmtree(dir_fd=)`` needs Python 3.11)."""
    try:
        top = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    try:
        for _, dirnames, filenames, fd in os.fwalk(".", dir_fd=top, topdown=False, follow_symlinks=False):
            for entry in filenames:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry, dir_fd=fd)
            for entry in dirnames:  # fwalk lists a link to a directory here, without descending into it
                try:
                    os.rmdir(entry, dir_fd=fd)
                except NotADirectoryError:
                    os.unlink(entry, dir_fd=fd)
                except FileNotFoundError:
                    pass
    finally:
        os.close(top)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)


class DirWalk:
    """Descriptors of a root and of the directories of keys under it, reached without following links.

    Args:
        root: the root directory (already resolved; the storage's constructor checked it).
        uri: the storage URI, for messages.

    The root's identity (device, inode) is recorded here; every walk checks that the path still names that
    directory, so a root swapped for another directory (or a link) after the storage was opened is refused.

    Thread safety: stateless apart from the recorded identity; any thread may walk.
    """

    def __init__(self, root: str | os.PathLike[str], uri: str) -> None:
        self.root = os.fspath(root)
        self.uri = uri
        fd = self._open_root_unchecked()
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        self.identity = (st.st_dev, st.st_ino)

    def _open_root_unchecked(self) -> int:
        try:
            return os.open(self.root, DIR_FLAGS)
        except NotADirectoryError:
            raise StorageError(
                f"checkpoint root {self.root} is no longer a directory (replaced by a link or a file?)",
                tier=self.uri,
            ) from None

    def open_root(self) -> int:
        """A descriptor of the root; raises :class:`StorageError` if the root was replaced."""
        fd = self._open_root_unchecked()
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            os.close(fd)
            raise StorageError(
                f"checkpoint root {self.root} was replaced by another directory after it was opened; refusing "
                "to use it",
                tier=self.uri,
            )
        return fd

    def open_dirs(self, parts: Sequence[str], key: str, *, create: bool = False) -> int:
        """A descriptor of the directory ``parts`` (components under the root), walked one component at
        a time with ``O_NOFOLLOW``; missing directories are created when ``create``.

        Raises:
            FormatError: a component is a symbolic link.
            ObjectNotFoundError: a component is missing (and not ``create``) or is not a directory.
        """
        fd = self.open_root()
        try:
            for depth, name in enumerate(parts):
                nfd = self._open_dir_at(fd, name, key, "/".join(parts[: depth + 1]), create)
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def parent(self, parts: Sequence[str], key: str, *, create: bool = False) -> Iterator[int]:
        """The directory holding the key's last component, as a descriptor closed at the end of the block."""
        fd = self.open_dirs(parts[:-1], key, create=create)
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_dir_at(self, dir_fd: int, name: str, key: str, component: str, create: bool) -> int:
        for _ in range(3):  # a directory removed between our mkdir and open is retried, a bounded number of times
            try:
                return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):  # a concurrent writer made it first: fine
                    os.mkdir(name, 0o777, dir_fd=dir_fd)
            except (NotADirectoryError, OSError) as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                # O_NOFOLLOW | O_DIRECTORY on a link fails with ENOTDIR (Linux) or ELOOP: tell which it was
                try:
                    mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                if stat.S_ISLNK(mode):
                    raise refuse_link(key, component) from None
                raise ObjectNotFoundError(
                    f"{key!r}: {component!r} on {self.uri} is {describe_mode(mode)}, not a directory",
                    tier=self.uri,
                    key=key,
                ) from None
        raise ObjectNotFoundError(f"{key!r}: directory {component!r} keeps disappearing", tier=self.uri, key=key)


def read_regular_file(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """At most ``max_bytes + 1`` bytes of the file ``path`` (so a caller can tell a longer file), which must be a
    regular file: opened without blocking, so a FIFO put there (no writer) cannot stall the caller.

    Raises:
        FileNotFoundError: nothing at ``path``.
        OSError: it cannot be read, or it is not a regular file (``EINVAL``).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
