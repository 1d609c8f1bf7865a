"""Wake a watcher when a directory changes (Linux inotify, through libc; no dependency).

Scope: one inotify descriptor on a few directories of a local root, and a bounded wait that returns early when
an entry is created, renamed in or removed there (a commit renames a complete step directory into the root; a
movable tag is renamed into ``tags/``). Anti-scope: what changed (the caller lists the root again: an event is
only a hint, and an event lost to a full queue costs one poll interval, never a missed checkpoint).

Where inotify is missing (not Linux, a file system that sends no events, such as NFS for another client's
writes), :func:`dir_notifier` returns None and the caller polls.
"""

from __future__ import annotations

import ctypes
import os
import select
from collections.abc import Iterable
from pathlib import Path

__all__ = ["DirNotifier", "dir_notifier"]

_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_IN_CREATE, _IN_DELETE, _IN_MOVED_FROM, _IN_MOVED_TO, _IN_CLOSE_WRITE = 0x100, 0x200, 0x40, 0x80, 0x8
_IN_ONLYDIR, _IN_DONT_FOLLOW = 0x01000000, 0x02000000
_MASK = _IN_CREATE | _IN_DELETE | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CLOSE_WRITE | _IN_ONLYDIR | _IN_DONT_FOLLOW


def _libc() -> ctypes.CDLL | None:
    """The process's own C library symbols (as files.py reaches renameat2), with inotify's two calls typed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    except (OSError, AttributeError):
        return None
    return libc


class DirNotifier:
    """An inotify descriptor watching some directories; :meth:`wait` blocks until one changes or ``timeout``."""

    def __init__(self, fd: int, libc: ctypes.CDLL) -> None:
        self._fd = fd
        self._libc = libc
        self._watched: set[Path] = set()

    def add(self, directory: Path) -> bool:
        """Watch ``directory`` too (not through a link); False when it is missing or cannot be watched."""
        if directory in self._watched:
            return True
        if self._libc.inotify_add_watch(self._fd, os.fsencode(directory), _MASK) < 0:
            return False
        self._watched.add(directory)
        return True

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a change; True when one came (its events are consumed)."""
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
        if not ready:
            return False
        try:
            while os.read(self._fd, 65536):
                pass
        except BlockingIOError:
            pass
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def dir_notifier(directories: Iterable[Path]) -> DirNotifier | None:
    """A notifier on ``directories`` (those that exist); None where inotify is unavailable or none could be
    watched."""
    libc = _libc()
    if libc is None:
        return None
    fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        return None
    notifier = DirNotifier(fd, libc)
    if not [d for d in directories if notifier.add(d)]:
        notifier.close()
        return None
    return notifier
