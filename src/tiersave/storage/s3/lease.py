"""The writer lock of an object-store root: a lease object with a heartbeat and an expiry.

Scope: :class:`Lease`, taken by :meth:`S3Storage.writer_lock`. Object stores have no lock, so the lock is
an object, ``ROOT/tiersave-writer.lock``, naming its holder (host, pid, since when, a random token) and
its time to live (``TIERSAVE_LEASE_TTL_S``, default 60 s):

- **Taking it** is a create-only PUT (``If-None-Match: *``, specified by S3; the store answers 412 when the
  object exists), so of two writers starting at once exactly one creates it.
- **Holding it**: a heartbeat thread renews it every third of its time to live. Each renewal first reads
  the lease back and checks that its token is still this writer's; a writer that finds a successor's
  token (it was paused longer than the lease lasts) has lost the lock, and its next save fails with
  :class:`~tiersave.errors.WriterLockedError` instead of writing beside the successor. The renewal
  replaces only the version it read (``If-Match``, S3's conditional write), so a successor's lease
  written between the read and the renewal is never overwritten: the renewal fails and this writer
  knows at once that it lost the lock. A save is also refused once the lease has gone unrenewed for its
  time to live, whatever the heartbeat is doing.
- **Expiry**: a lease whose object was last written (the store's own ``Last-Modified``, so the holder's
  clock does not matter) longer than its time to live ago, or whose holder ran on this host and is
  gone, is stale: it is replaced by a conditional write naming the version judged stale (of two
  successors, or a successor and a holder renewing at that moment, one succeeds; the other reads the
  lease again) and the takeover is reported with a note. A lease that is not yet stale is watched for at
  most its time to live: renewed meanwhile, its writer lives and the new writer is refused (within one
  heartbeat); not renewed, it expires and is taken over, so a job restarted right after its predecessor
  died on another node goes on instead of failing.
- **Stores without If-Match**: not every S3-compatible store honours it. Before touching the lease, a
  writer probes on a scratch object of its own (``tiersave-writer.lock.probe-TOKEN``, deleted at once):
  a conditional write naming its version must be accepted, and one naming a version it does not have
  refused (a timeout or a busy store is no evidence: the error goes to the caller). Where the store
  fails either, a warning says so, renewals read back and overwrite, and a
  takeover deletes the stale lease and creates it anew (create-only): a successor's lease written
  between two such requests is lost, and that successor finds another writer's lease at its own next
  heartbeat and is the one refused.
- **Releasing** deletes the lease after reading back that it is still this writer's.

Anti-scope: file systems (``flock``, :mod:`tiersave.storage.posix.lock`); who takes the lock. Uses only
the :class:`~tiersave.storage.base.Storage` protocol (create-only put, get, head, delete), and the
optional :class:`~tiersave.storage.base.ConditionalUpdate` where the backend has it, so any backend with
``capabilities.conditional_put`` can hold one.
"""

from __future__ import annotations

import logging
import threading
import time

from ...errors import (
    AlreadyExistsError,
    ConfigError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StorageError,
    TiersaveError,
    TransientStorageError,
    WriterLockedError,
)
from ...knobs import int_env
from ..base import ConditionalUpdate, Storage
from ..lock import LOCK_NAME, MAX_LOCK_BYTES, LockHolder, refused, taken_over_note

__all__ = ["Lease", "lease_ttl_s"]

log = logging.getLogger(__name__)

_TTL_ENV = "TIERSAVE_LEASE_TTL_S"

_NO_SUCH_VERSION = '"tiersave-no-such-version"'
"""The version the probe names last: no object has it, so a store that honours ``If-Match`` refuses it."""


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
        self.note: str | None = None
        self._stop = threading.Event()
        self._versioned = storage if isinstance(storage, ConditionalUpdate) else None
        self.conditional = self._probe_if_match()
        """Whether renewals and takeovers replace only the version read (the store honours ``If-Match``)."""
        self._renewed = time.monotonic()  # when the lease was last written, taken as the request was sent
        self._take()
        self._thread = threading.Thread(target=self._heartbeat, name="tiersave-lease", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        deleted: tuple[LockHolder, str] | None = None  # the stale lease deleted for the next create (no If-Match)
        for _ in range(3):  # bounded: each round takes the lease, refuses, or replaces a stale one
            try:
                self._renewed = time.monotonic()
                self.storage.put(LOCK_NAME, self.holder.to_bytes(), mode="create")
                if deleted is not None:
                    self.note = taken_over_note(self.uri, *deleted)
                return
            except AlreadyExistsError:
                deleted = None
            found = self._current()
            if found is None:
                continue  # released meanwhile: try to create it again
            if found[0] == self.holder:
                return  # this writer's own write of an earlier round, whose response was lost
            stale = self._wait_stale(*found)
            if stale is None:
                continue  # released while this writer waited: create it (never delete what is there now)
            current, why, version = stale
            self._renewed = time.monotonic()
            if self._replace_stale(version):
                if current is not None:
                    self.note = taken_over_note(self.uri, current, why)
                return
            if not self.conditional and current is not None:
                deleted = (current, why)
        raise refused(self.uri, None, " (the lease changed hands while it was being taken; try again)")

    def _replace_stale(self, version: str) -> bool:
        """Put this writer's lease in place of the stale one read as ``version``. True when it is this
        writer's now; False when the next round must read it again (another writer changed it first) or,
        on a store without ``If-Match``, create it (deleted here). Any other error propagates: whether the
        write landed is unknown, so nothing is deleted on a guess."""
        if self.conditional and version and self._versioned is not None:
            try:
                self._versioned.put_if_version(LOCK_NAME, self.holder.to_bytes(), version)
                return True
            except PreconditionFailedError:
                return False
        self.storage.delete(LOCK_NAME)
        return False

    def _current(self) -> tuple[LockHolder | None, float, str] | None:
        """The lease's holder, the store's time of its last write and its version ("" where the store has
        no versions); None if there is no lease."""
        try:
            if self._versioned is not None:
                got = self._versioned.get_version(LOCK_NAME, max_bytes=MAX_LOCK_BYTES)
                return LockHolder.parse(got.data), got.mtime, got.version
            mtime = self.storage.head(LOCK_NAME).mtime
            return LockHolder.parse(self.storage.get(LOCK_NAME, max_bytes=MAX_LOCK_BYTES)), mtime, ""
        except ObjectNotFoundError:
            return None

    def _probe_if_match(self) -> bool:
        """Whether the store honours ``If-Match`` on PUT, tried on a scratch object of this writer's own (the
        lease is not touched): a conditional write naming the object's version must be accepted, and one
        naming a version it does not have refused."""
        if self._versioned is None:
            return False
        key = f"{LOCK_NAME}.probe-{self.holder.token}"
        data = self.holder.to_bytes()
        try:
            self.storage.put(key, data, mode="create")
            try:
                version = self._versioned.get_version(key, max_bytes=MAX_LOCK_BYTES).version
                self._versioned.put_if_version(key, data, version)
                try:
                    self._versioned.put_if_version(key, data, _NO_SUCH_VERSION)
                except PreconditionFailedError:
                    return True
                why = "ignores If-Match (S3's conditional write)"
            finally:
                try:
                    self.storage.delete(key)
                except StorageError as exc:
                    log.warning("tiersave: could not delete the scratch object %s of %s: %s", key, self.uri, exc)
        except TransientStorageError:
            raise  # no evidence about If-Match: a timeout or a busy store must not weaken the lock for good
        except (StorageError, ConfigError) as exc:  # 400, 501 (errors.py: not transient), no ETag
            why = f"refuses conditional writes (If-Match: {exc})"
        log.warning(
            "tiersave: %s %s: the writer lock's lease is renewed by reading it back and overwriting it, and taken "
            "over by deleting and creating it (docs/guarantees.md, 'One writer per root')",
            self.uri,
            why,
        )
        return False

    def _wait_stale(
        self, current: LockHolder | None, mtime: float, version: str
    ) -> tuple[LockHolder | None, str, str] | None:
        """Wait (at most the lease's time to live) until the lease is known stale, and say why (with the
        version that was judged stale); None if it was released meanwhile; raise WriterLockedError as soon
        as it is renewed, i.e. its writer lives.

        Waiting instead of refusing at once lets a job restarted on another node right after its
        predecessor died take the root over, while a live writer is still refused within a third of the
        time to live (its next heartbeat)."""
        ttl = current.ttl_s if current is not None and current.ttl_s > 0 else self.holder.ttl_s
        while True:
            if current is not None and current.alive() is False:
                return current, "that process is no longer running", version
            age = time.time() - mtime
            if age > ttl + 1.0:  # + the second resolution of Last-Modified
                return current, f"not renewed for {age:.0f} s, its time to live is {ttl:.0f} s", version
            time.sleep(min(ttl + 1.5 - age, max(0.2, ttl / 6)))
            found = self._current()
            if found is None:
                return None
            if found[1] != mtime or (found[0] != current):
                raise refused(self.uri, found[0], ", renewing its lease")
            current, mtime, version = found

    def _read_back(self) -> LockHolder | None:
        found = self._current()
        return found[0] if found is not None else None

    def _heartbeat(self) -> None:
        interval = self.holder.ttl_s / 3
        while not self._stop.wait(interval):
            try:
                sent = time.monotonic()  # the store's Last-Modified is no earlier than this
                self._lost = self._renew()
                if self._lost is not None:
                    log.warning("tiersave: lost the writer lock of %s: %s", self.uri, self._lost)
                    return
                self._renewed = sent
            except TiersaveError as exc:  # retried next beat; lost only once the lease may have expired
                silent = time.monotonic() - self._renewed
                log.warning("tiersave: could not renew the writer lock of %s: %s", self.uri, exc)
                if silent > self.holder.ttl_s:
                    self._lost = f"it could not be renewed for {silent:.0f} s (last error: {exc})"
                    return

    def _renew(self) -> str | None:
        """Renew the lease if it is still this writer's; else say who has it."""
        current, _, version = self._current() or (None, 0.0, "")
        if current is None or current.token != self.holder.token:
            who = current.describe() if current is not None else "nobody (the lease object is gone)"
            return f"the lease was taken over by {who}"
        renewed = self.holder.renew()
        if self.conditional and version and self._versioned is not None:
            try:
                self._versioned.put_if_version(LOCK_NAME, renewed.to_bytes(), version)
            except PreconditionFailedError:
                now = self._read_back()
                if now is None or now.token != self.holder.token:  # a successor's lease: left as it is
                    who = now.describe() if now is not None else "nobody (the lease object is gone)"
                    return f"the lease was taken over by {who} as this writer renewed it"
                if now != renewed:  # ours, not renewed: the beat failed (counted as silence, not as a renewal)
                    raise StorageError(
                        "the store refused to renew this writer's own lease (If-Match)", tier=self.uri, key=LOCK_NAME
                    ) from None
                # else our own renewal, retried after its response was lost
        else:
            self.storage.put(LOCK_NAME, renewed.to_bytes(), mode="overwrite")
        self.holder = renewed
        return None

    def check(self) -> None:
        """Raise if the lease was lost (taken over, or not renewed within its time to live, whether the
        heartbeat found out or is still waiting on a request)."""
        lost = self._lost
        silent = time.monotonic() - self._renewed
        if lost is None and silent > self.holder.ttl_s:
            lost = f"it was last renewed {silent:.0f} s ago, past its time to live ({self.holder.ttl_s:.0f} s)"
        if lost is not None:
            raise WriterLockedError(
                f"this process no longer holds the writer lock of {self.uri}: {lost}; another writer may "
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
        how = "If-Match" if self.conditional else "read, then overwrite"
        return f"Lease({self.uri!r}, {self.holder.describe()}, ttl {self.holder.ttl_s:.0f} s, renewed by {how})"
