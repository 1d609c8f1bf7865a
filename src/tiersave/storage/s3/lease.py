"""The writer lock of an object-store root: a lease object with a heartbeat and an expiry.

Scope: :class:`Lease`, taken by :meth:`S3Storage.writer_lock`. Object stores have no lock, so the lock is
an object, ``ROOT/tiersave-writer.lock``, naming its holder (host, pid, since when, a random token) and
its time to live (``TIERSAVE_LEASE_TTL_S``, default 60 s):

- **Taking it** is a create-only PUT (``If-None-Match: *``, specified by S3; the store answers 412 when the
  object exists), so of two writers starting at once exactly one creates it.
- **Holding it**: a heartbeat thread renews it every third of its time to live. Each renewal first reads
  the lease back and checks that its token is still this writer's; a writer that finds a successor's
  token (it was paused longer than the lease lasts) has lost the lock, and its next save fails with
  :class:`~tiersave.errors.WriterLockedError` instead of writing beside the successor.
- **Expiry**: a lease whose object was last written (the store's own ``Last-Modified``, so the holder's
  clock does not matter) longer than its time to live ago, or whose holder ran on this host and is
  gone, is stale: it is deleted, created anew (create-only again, so of two successors one wins) and
  the takeover is reported with a note.
- **Releasing** deletes the lease after reading back that it is still this writer's.

Anti-scope: file systems (``flock``, :mod:`tiersave.storage.posix.lock`); who takes the lock. Uses only
the :class:`~tiersave.storage.base.Storage` protocol (create-only put, get, head, delete), so any backend
with ``capabilities.conditional_put`` can hold one.
"""

from __future__ import annotations

import logging
import threading
import time

from ...errors import AlreadyExistsError, ObjectNotFoundError, StorageError, WriterLockedError
from ...knobs import int_env
from ..base import Storage
from ..lock import LOCK_NAME, MAX_LOCK_BYTES, LockHolder, refused, taken_over_note

__all__ = ["Lease", "lease_ttl_s"]

log = logging.getLogger(__name__)

_TTL_ENV = "TIERSAVE_LEASE_TTL_S"


def lease_ttl_s() -> int:
    """``TIERSAVE_LEASE_TTL_S``: how long a lease lasts without a heartbeat (default 60 s, 2 s to 1 h)."""
    return int_env(_TTL_ENV, 60, 2, 3600)


class Lease:
    """A held lease on an object-store root, renewed by a daemon thread until :meth:`release`.

    Args:
        storage: the root (any storage with a create-only put).
        ttl_s: the lease's time to live (None: ``TIERSAVE_LEASE_TTL_S``).

    Raises:
        WriterLockedError: a live (unexpired) lease of another writer holds the root.
    """

    def __init__(self, storage: Storage, *, ttl_s: float | None = None) -> None:
        self.storage = storage
        self.uri = storage.uri
        ttl = float(ttl_s if ttl_s is not None else lease_ttl_s())
        self.holder = LockHolder.mine(ttl)
        self._lost: str | None = None
        self._stop = threading.Event()
        self._take()
        self._renewed = time.monotonic()
        self._thread = threading.Thread(target=self._heartbeat, name="tiersave-lease", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        for _ in range(3):  # bounded: each round either takes the lease, refuses, or removes a stale one
            try:
                self.storage.put(LOCK_NAME, self.holder.to_bytes(), mode="create")
                return
            except AlreadyExistsError:
                pass
            try:
                info = self.storage.head(LOCK_NAME)
                current = LockHolder.parse(self.storage.get(LOCK_NAME, max_bytes=MAX_LOCK_BYTES))
            except ObjectNotFoundError:
                continue  # released meanwhile: try to create it again
            ttl = current.ttl_s if current is not None and current.ttl_s > 0 else self.holder.ttl_s
            age = time.time() - info.mtime
            alive = current.alive() if current is not None else None
            if alive is False:
                why = "that process is no longer running"
            elif age > ttl:
                why = f"not renewed for {age:.0f} s, its time to live is {ttl:.0f} s"
            else:
                expires = f"; it expires {ttl - age:.0f} s after its holder stops renewing it"
                raise refused(self.uri, current, expires)
            self.storage.delete(LOCK_NAME)
            if current is not None:
                taken_over_note(self.uri, current, why)
        raise refused(self.uri, None, " (the lease changed hands while it was being taken; try again)")

    def _read_back(self) -> LockHolder | None:
        try:
            return LockHolder.parse(self.storage.get(LOCK_NAME, max_bytes=MAX_LOCK_BYTES))
        except ObjectNotFoundError:
            return None

    def _heartbeat(self) -> None:
        interval = self.holder.ttl_s / 3
        while not self._stop.wait(interval):
            try:
                current = self._read_back()
                if current is None or current.token != self.holder.token:
                    who = current.describe() if current is not None else "nobody (the lease object is gone)"
                    self._lost = f"the lease was taken over by {who}"
                    log.warning("tiersave: lost the writer lock of %s: %s", self.uri, self._lost)
                    return
                self.holder = self.holder.renew()
                self.storage.put(LOCK_NAME, self.holder.to_bytes(), mode="overwrite")
                self._renewed = time.monotonic()
            except StorageError as exc:  # retried next beat; lost only once the lease may have expired
                silent = time.monotonic() - self._renewed
                log.warning("tiersave: could not renew the writer lock of %s: %s", self.uri, exc)
                if silent > self.holder.ttl_s:
                    self._lost = f"it could not be renewed for {silent:.0f} s (last error: {exc})"
                    return

    def check(self) -> None:
        """Raise if the lease was lost (taken over, or not renewed within its time to live)."""
        if self._lost is not None:
            raise WriterLockedError(
                f"this process no longer holds the writer lock of {self.uri}: {self._lost}; another writer may "
                "be saving there, so this save is refused",
                uri=self.uri,
            )

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this writer's. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=max(1.0, self.holder.ttl_s))
        if self._lost is not None:
            return
        current = self._read_back()
        if current is not None and current.token == self.holder.token:
            self.storage.delete(LOCK_NAME)

    def __repr__(self) -> str:
        return f"Lease({self.uri!r}, {self.holder.describe()}, ttl {self.holder.ttl_s:.0f} s)"
