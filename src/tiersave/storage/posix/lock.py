"""The writer lock of a directory root: an advisory ``flock`` on ``ROOT/tiersave-writer.lock``.

Scope: :class:`FileWriterLock`, taken by :meth:`LocalStorage.writer_lock` (local disk, shared file systems,
``mem://``). The kernel holds the lock for as long as the open file description lives, so a writer that
dies (``kill -9`` included) releases it at once and nothing can be left stale; the holder's host, pid and
start time are written in the file for the message a second writer gets. ``flock`` conflicts between two
opens of the file even within one process, so two Checkpointers of one process on one root are refused
too. On NFS, Linux maps ``flock`` to a byte-range lock the server arbitrates between clients.
Anti-scope: deciding who takes the lock (:mod:`tiersave.storage.lock`), object stores (a lease:
:mod:`tiersave.storage.s3.lease`).

The lock file is opened like every other file of a root: relative to the root's descriptor, never through
a link, regular files only, never blocking (:mod:`tiersave.storage.posix.safepath`).
"""

from __future__ import annotations

import fcntl
import os
import threading

from ..lock import LOCK_NAME, MAX_LOCK_BYTES, LockHolder, refused, taken_over_note
from .files import O_CLOEXEC, os_errors, write_all
from .safepath import READ_FLAGS, DirWalk, open_regular_at

__all__ = ["FileWriterLock"]

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


class FileWriterLock:
    """A held ``flock`` on a root's lock file. Release with :meth:`release` (or by ending the process).

    Args:
        dirs: the root's safe directory walker.
        uri: the root, for messages.

    Raises:
        WriterLockedError: another open of the lock file (any process, this one included) holds it.
    """

    def __init__(self, dirs: DirWalk, uri: str) -> None:
        self.uri = uri
        self._lock = threading.Lock()
        with os_errors(uri, "opening the writer lock", LOCK_NAME):
            root = dirs.open_root()
            try:
                try:  # created with a plain file's mode; then opened by the same rules as any file of a root
                    os.close(os.open(LOCK_NAME, _CREATE_FLAGS, 0o644, dir_fd=root))
                except FileExistsError:
                    pass
                self._fd: int | None = open_regular_at(root, LOCK_NAME, LOCK_NAME, READ_FLAGS | os.O_RDWR)
            finally:
                os.close(root)
        try:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise refused(uri, LockHolder.parse(self._read())) from None
            previous = LockHolder.parse(self._read())
            self.holder = LockHolder.mine()
            with os_errors(uri, "writing the writer lock", LOCK_NAME):
                os.ftruncate(self._fd, 0)
                write_all(self._fd, memoryview(self.holder.to_bytes()), 0)
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise
        self.note: str | None = None
        if previous is not None:  # a clean release empties the file: this writer ended without releasing
            alive = previous.alive()
            why = "that process is no longer running" if alive is False else "it no longer holds the lock"
            self.note = taken_over_note(uri, previous, why)

    def _read(self) -> bytes:
        assert self._fd is not None
        try:
            return os.pread(self._fd, MAX_LOCK_BYTES + 1, 0)
        except OSError:
            return b""

    def check(self) -> None:
        """A file lock cannot be lost while the process lives: nothing to check."""

    def release(self) -> None:
        """Empty the lock file (so the next writer knows this one ended cleanly) and unlock it. Idempotent."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # the lock itself is what matters; it goes with the descriptor
        finally:
            os.close(fd)

    def __del__(self) -> None:  # a Checkpointer dropped without close() must not keep its root locked
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"FileWriterLock({self.uri!r}, {self.holder.describe()})"
