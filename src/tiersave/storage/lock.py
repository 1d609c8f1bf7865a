"""One writer per root: who holds a root's writer lock, and taking the locks of a writer's tiers.

Scope: :class:`LockHolder` (host, pid, since when, as written in the lock), the :class:`WriterLock`
protocol the backends implement (an advisory ``flock`` on file systems,
:mod:`tiersave.storage.posix.lock`; a lease object with heartbeat and expiry on object stores,
:mod:`tiersave.storage.s3.lease`), :func:`hold_writer_locks` (all the locks of one writer's tiers, or
none), and whether a holder of this host is still running. Anti-scope: who is a writer (the
Checkpointer decides: the process, or the rank, that commits), checkpoints and their layout.

Two writers on one root would each delete the other's checkpoints by retention and be acknowledged
the same steps with different contents, so the second live writer is refused with
:class:`~tiersave.errors.WriterLockedError` naming the holder. A lock left by a writer that died is
taken over with a note (a log warning, and the lock's ``note``). Readers never take a lock.

The lock is advisory: it protects against a second tiersave writer, not against someone deleting
files by hand. ``TIERSAVE_WRITER_LOCK=0`` (or ``Checkpointer(writer_lock=False)``) turns it off for
deliberate cases, e.g. a storage layer that already arbitrates writers.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import WriterLockedError
from ..format.layout import new_token
from .base import Storage

__all__ = [
    "LOCK_NAME",
    "LockHolder",
    "RootLocks",
    "WriterLock",
    "hold_writer_locks",
    "locks_enabled",
    "release_all",
    "taken_over_note",
]

log = logging.getLogger(__name__)

LOCK_NAME = "tiersave-writer.lock"
"""The lock file (file systems) or lease object (object stores) at the top of a root."""

MAX_LOCK_BYTES = 4096
_LOCK_ENV = "TIERSAVE_WRITER_LOCK"


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or held) a root's writer lock, as written in the lock itself.

    Attributes:
        host: the host name of the writer.
        pid: its process id on that host.
        since: when it took the lock (seconds since the epoch).
        token: a random id of this holding, so a writer can tell its own lease from a successor's.
        renewed: when the lease was last renewed (object stores; ``since`` elsewhere).
        ttl_s: how long after ``renewed`` the lease expires without a heartbeat (0: no expiry, a file lock).
    """

    host: str
    pid: int
    since: float
    token: str
    renewed: float = 0.0
    ttl_s: float = 0.0

    @classmethod
    def mine(cls, ttl_s: float = 0.0) -> LockHolder:
        """This process as a holder, from now."""
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), now, new_token(), now, ttl_s)

    def renew(self) -> LockHolder:
        """The same holding, renewed now."""
        return LockHolder(self.host, self.pid, self.since, self.token, time.time(), self.ttl_s)

    def to_bytes(self) -> bytes:
        doc = {
            "host": self.host,
            "pid": self.pid,
            "since": self.since,
            "token": self.token,
            "renewed": self.renewed,
            "ttl_s": self.ttl_s,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes) -> LockHolder | None:
        """The holder a lock's bytes name; None for an empty, oversized or malformed lock (never raises)."""
        if not data or len(data) > MAX_LOCK_BYTES:
            return None
        try:
            doc: Any = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None
        if not isinstance(doc, dict):
            return None
        host, pid, token = doc.get("host"), doc.get("pid"), doc.get("token")
        since, renewed, ttl = doc.get("since"), doc.get("renewed", 0.0), doc.get("ttl_s", 0.0)
        numbers = (since, renewed, ttl)
        if not (isinstance(host, str) and isinstance(token, str) and len(host) <= 255 and len(token) <= 64):
            return None
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 2**31:
            return None
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e11 for v in numbers):
            return None
        return cls(host, pid, float(since), token, float(renewed), float(ttl))  # type: ignore[arg-type]

    def describe(self) -> str:
        """``pid 1234 on host node7 since 2026-11-23 14:03:11 UTC``."""
        return f"pid {self.pid} on host {self.host} since {_utc(self.since)}"

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool | None:
        """True/False when the holder runs on this host and is known alive/dead; None on another host."""
        if not self.on_this_host():
            return None
        if self.pid == os.getpid():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's live process
            return True
        return True


def _utc(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class WriterLock(Protocol):
    """A held writer lock on one root. Backends: ``LocalStorage.writer_lock``, ``S3Storage.writer_lock``."""

    uri: str
    holder: LockHolder
    note: str | None
    """Set when this lock was taken over from a writer that ended without releasing it."""

    def check(self) -> None:
        """Raise :class:`WriterLockedError` if the lock was lost (a lease that expired and was taken)."""

    def release(self) -> None:
        """Give the lock up. Idempotent; never raises for a lock already gone."""


def locks_enabled() -> bool:
    """``TIERSAVE_WRITER_LOCK`` (default 1): 0 turns the writer lock off in this process."""
    raw = os.environ.get(_LOCK_ENV, "").strip()
    return raw not in ("0", "false", "no", "off")


def refused(uri: str, holder: LockHolder | None, detail: str = "") -> WriterLockedError:
    """The error for a root whose lock another live writer holds."""
    who = holder.describe() if holder is not None else "another process (its lock names no holder)"
    return WriterLockedError(
        f"{uri} is being written by {who}{detail}: two writers on one root would delete each other's "
        "checkpoints. Stop the other writer, use another root, or, if this is deliberate, turn the lock off "
        f"with writer_lock=False or {_LOCK_ENV}=0",
        uri=uri,
        holder=None if holder is None else {"host": holder.host, "pid": holder.pid, "since": holder.since},
    )


def taken_over_note(uri: str, previous: LockHolder, why: str) -> str:
    """Report a stale lock taken over, as a log warning (not a Python warning: every job resumed after a
    crash or a preemption takes one over, and that is the normal path). Returns the note."""
    message = f"took over the writer lock of {uri} left by {previous.describe()} ({why})"
    log.warning("tiersave: %s", message)
    return message


def hold_writer_locks(storages: Iterable[Storage]) -> list[WriterLock]:
    """Take the writer lock of every storage that has one (``writer_lock()``), all or none.

    A storage without a ``writer_lock`` method (a custom backend) is written without one.

    Raises:
        WriterLockedError: another live writer holds one of them; the locks taken so far are released.
    """
    held: list[WriterLock] = []
    try:
        for storage in storages:
            take = getattr(storage, "writer_lock", None)
            if callable(take):
                held.append(take())
    except BaseException:
        release_all(held)
        raise
    return held


def release_all(locks: Iterable[WriterLock]) -> None:
    """Release every lock; a failure to release one is logged (its lease expires), never raised."""
    for lock in locks:
        try:
            lock.release()
        except Exception as exc:  # the lock expires or dies with the process anyway
            log.warning("could not release the writer lock of %s: %s", lock.uri, exc)


class RootLocks:
    """The writer locks of one writer's roots: taken all together at its first write, held until released.

    Args:
        storages: returns the roots to lock (called once, at the first :meth:`hold`).
        enabled: False (``writer_lock=False``, not the committing rank): :meth:`hold` does nothing.
            ``TIERSAVE_WRITER_LOCK=0`` turns it off too.

    Thread safety: one writer thread calls :meth:`hold`; :meth:`release` from any thread, once the writes
    are over.
    """

    def __init__(self, storages: Callable[[], Iterable[Storage]], *, enabled: bool) -> None:
        self._storages = storages
        self.enabled = enabled and locks_enabled()
        self.held: list[WriterLock] | None = None

    def hold(self) -> None:
        """Before anything is written: take every root's lock (the first time), or check it is still held.

        Raises:
            WriterLockedError: another live writer holds a root, or this writer's lease was lost.
        """
        if not self.enabled:
            return
        if self.held is None:
            self.held = hold_writer_locks(self._storages())
        for lock in self.held:
            lock.check()

    def release(self) -> None:
        """Give every lock up (idempotent); the next :meth:`hold` takes them again."""
        held, self.held = self.held, None
        release_all(held or [])
