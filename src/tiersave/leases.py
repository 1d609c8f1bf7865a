"""Read leases: a reader in another process keeps the checkpoint it reads safe from the writer's retention.

A reader (``restore``, ``export``, ``copy``, ``verify``, a ``watch`` consumer) writes one small record per
(step, reader), ``ROOT/leases/step-N/read-<host>-<pid>-<token>.json``, with one atomic put (temporary file +
rename on file systems, a single PUT on object stores) and renews it from a background thread every third of
its time to live (``TIERSAVE_READ_LEASE_TTL_S``, default 30 s) until the read ends. Retention (any process,
``tiersave prune`` included) deletes a step only under its own record, ``ROOT/leases/step-N/deleting.json``,
and only when no live lease of that step is there. The order both sides follow closes the race between a
reader choosing a step and retention deleting it (docs/guarantees.md, "Read leases"):

- reader: put the lease, **then** check that no deletion record is there and that the step is committed
  (else drop the lease: :class:`CheckpointNotFoundError`);
- retention: put the deletion record, **then** read the step's leases; delete (un-commit, then the data) only
  if none is live, and remove the deletion record after.

Scope: the lease and deletion records of one root (their names, writing, renewing, judging them live,
removing expired ones), the one renewal thread of a process, and the deletion of one committed checkpoint
(un-commit first) that retention runs under a deletion record. Anti-scope: what retention deletes and how
(catalog.py decides and deletes under :meth:`LeaseStore.deleting`), the in-process protection of steps being
read or drained (references.py ``Protection``, no I/O), the writer lock (storage/lock.py, whose ``LockHolder``
record a lease reuses).

Torch-free, so ``tiersave verify``/``export``/``copy`` lease what they read on any machine.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager, suppress

from .errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    FormatError,
    NoSpaceError,
    ObjectNotFoundError,
    PermissionDeniedError,
    StorageError,
    TiersaveWarning,
)
from .format.layout import MANIFEST_NAME, new_token, parse_step_dirname, step_dirname, trash_dirname
from .knobs import int_env
from .storage.base import PutMode, Storage
from .storage.lock import MAX_LOCK_BYTES, LockHolder
from .storage.posix import LocalStorage

__all__ = ["LEASES_PREFIX", "LeaseStore", "ReadLease", "delete_committed", "read_lease_ttl_s"]

log = logging.getLogger(__name__)

LEASES_PREFIX = "leases"
DELETING_NAME = "deleting.json"
_TTL_ENV = "TIERSAVE_READ_LEASE_TTL_S"
MAX_TTL_S = 3600.0
"""A record claiming a longer life is judged with this one: a forged record cannot pin a step for long."""
_SLACK_S = 1.0
"""Object stores' ``Last-Modified`` has a one-second resolution."""
_DELETING_WAIT_S = 2.0
"""How long a reader waits for a deletion record to go (retention decides within milliseconds)."""
_HOST = re.compile(r"[^A-Za-z0-9_.-]")


def read_lease_ttl_s() -> int:
    """``TIERSAVE_READ_LEASE_TTL_S``: how long a read lease lasts without renewal (default 30 s, 2 s to 1 h)."""
    return int_env(_TTL_ENV, 30, 2, int(MAX_TTL_S))


def _put(storage: Storage, key: str, data: bytes, mode: PutMode) -> None:
    """Write a lease or deletion record: atomic, and on a file system without fsyncs (a record need not outlive
    a power loss, which ends its reader too, and two fsyncs would cost a local read milliseconds)."""
    if isinstance(storage, LocalStorage):
        storage.put(key, data, mode=mode, durable=False)
    else:
        storage.put(key, data, mode=mode)


Reclaim = Callable[[Storage, str], None]
"""Removes a renamed-away checkpoint directory later (reclaim.py)."""


def delete_committed(storage: Storage, step: int, attempts: Collection[str], reclaim: Reclaim | None = None) -> None:
    """Delete the committed checkpoint of ``step``: un-commit it atomically first, then remove its data, so a
    reader that leases it from now on finds it gone. File systems rename the step's directory to a trash
    name (then remove it); object stores delete the manifest (the commit marker), then ``attempts``: only the
    attempt prefixes that manifest names, as a concurrent re-save of the step writes under its own attempt
    prefix, which must survive (unnamed leftovers go with ``Catalog.clean_leftovers``). ``reclaim``: removes
    the renamed directory later (reclaim.py) instead of now."""
    name = step_dirname(step)
    if storage.capabilities.atomic_rename:
        trash = trash_dirname(step, new_token())
        storage.rename_prefix(name, trash)
        if reclaim is not None:
            reclaim(storage, trash)
        else:
            storage.delete_prefix(trash)
        return
    storage.delete(f"{name}/{MANIFEST_NAME}")
    for attempt in sorted(attempts):
        storage.delete_prefix(f"{name}/{attempt}")


class ReadLease:
    """A held read lease on one step, renewed by the process's renewal thread until :meth:`release`."""

    def __init__(self, storage: Storage, step: int, key: str, holder: LockHolder) -> None:
        self.storage = storage
        self.step = step
        self.key = key
        self.holder = holder
        self._lock = threading.Lock()  # a renewal never re-creates a released lease
        self._released = False
        self.also: list[ReadLease] = []  # the leases of the steps it references, released with it
        self._renewed = time.monotonic()
        self._due = self._renewed + holder.ttl_s / 3

    def renew_due(self) -> float:
        """When (``time.monotonic()``) the renewal thread next writes this lease: a third of its time to live
        after the last write."""
        return self._due

    def renew(self) -> None:
        """Write the lease again with a fresh time (renewal thread)."""
        with self._lock:
            if self._released:
                return
            try:
                self.holder = self.holder.renew()
                _put(self.storage, self.key, self.holder.to_bytes(), "overwrite")
                self._renewed = time.monotonic()
                self._due = self._renewed + self.holder.ttl_s / 3
            except StorageError as exc:  # tried again a third of the time to live later
                self._due = time.monotonic() + self.holder.ttl_s / 3
                silent = time.monotonic() - self._renewed
                log.warning(
                    "tiersave: could not renew the read lease %s on %s (%.0f s): %s",
                    self.key,
                    self.storage.uri,
                    silent,
                    exc,
                )

    def release(self) -> None:
        """Stop renewing and remove the lease. Idempotent; a lease that cannot be removed just expires."""
        with self._lock:
            if self._released:
                return
            self._released = True
        for other in self.also:
            other.release()
        _RENEWER.discard(self)
        if self.holder.pid != os.getpid():  # a forked child's copy: the lease is its parent's to remove
            return
        try:
            self.storage.delete(self.key)
        except StorageError as exc:
            log.warning(
                "tiersave: could not remove the read lease %s on %s (it expires): %s", self.key, self.storage.uri, exc
            )

    def __enter__(self) -> ReadLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"ReadLease({self.storage.uri!r}, step {self.step}, {self.holder.describe()})"


class _Renewer:
    """The one daemon thread of a process renewing each of its read leases every third of that lease's time
    to live; it ends when no lease is held. A lease added while the thread sleeps wakes it, so a lease with a
    shorter time to live than the others is renewed on its own schedule, not at the end of their sleep."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: set[ReadLease] = set()
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def add(self, lease: ReadLease) -> None:
        with self._lock:
            self._leases.add(lease)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiersave-read-leases", daemon=True)
                self._thread.start()
        self._wake.set()

    def discard(self, lease: ReadLease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._leases:
                    self._thread = None
                    return
                held = list(self._leases)
            now = time.monotonic()
            for lease in held:
                if now >= lease.renew_due():
                    lease.renew()
            self._wake.clear()
            with self._lock:
                dues = [lease.renew_due() for lease in self._leases]
            if dues:
                self._wake.wait(max(0.0, min(dues) - time.monotonic()))

    def release_all(self) -> None:
        """At interpreter exit: remove the leases still held, rather than leave them pinning steps until they
        expire (a killed process cannot; its leases expire)."""
        with self._lock:
            held = list(self._leases)
        for lease in held:
            lease.release()

    def forget(self) -> None:
        """In a forked child: the leases are the parent's (renewed and removed by it), and no thread runs."""
        self._lock = threading.Lock()
        self._leases = set()
        self._thread = None
        self._wake = threading.Event()


_RENEWER = _Renewer()
atexit.register(_RENEWER.release_all)
os.register_at_fork(after_in_child=_RENEWER.forget)
_WARNED: set[str] = set()  # roots where a lease could not be written: warned once per process


class LeaseStore:
    """The read leases and deletion records of one root. Any thread, any process."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def _dir(self, step: int) -> str:
        return f"{LEASES_PREFIX}/{step_dirname(step)}"

    # -- readers ----------------------------------------------------------------------------------

    def take(self, step: int, referenced: Collection[int] = ()) -> ReadLease | None:
        """Lease ``step`` for reading, and the ``referenced`` steps whose shards it reads (an incremental
        checkpoint's bases), released together; None (a warning, once per root) where no lease can be
        written (a read-only or full root): the read then goes on unprotected, as before leases existed.

        Raises:
            CheckpointNotFoundError: ``step`` (or a referenced step) is not committed, or retention is deleting it.
        """
        lease = self._take(step)
        if lease is None:
            return None
        try:
            for base in sorted(set(referenced) - {step}):
                also = self._take(base)
                if also is not None:
                    lease.also.append(also)
        except BaseException:
            lease.release()
            raise
        return lease

    def _take(self, step: int) -> ReadLease | None:
        holder = LockHolder.mine(float(read_lease_ttl_s()))
        host = _HOST.sub("_", holder.host)[:64]
        key = f"{self._dir(step)}/read-{host}-{holder.pid}-{new_token()}.json"
        try:
            _put(self.storage, key, holder.to_bytes(), "create")
        except (PermissionDeniedError, NoSpaceError) as exc:  # a read-only or full root still reads
            self._check_committed(step)
            self._warn_unleased(exc)
            return None
        except StorageError:
            # The lease may be there all the same (a retention emptying this step's lease folder unlinked the
            # temporary file between its link and unlink; a PUT landed but its reply was lost): remove it, or,
            # renewed by no one, it would hold the step for a time to live. The key is this take's own.
            with suppress(StorageError):
                self.storage.delete(key)
            self._check_committed(step)  # its lease directory removed with the step: not committed any more
            raise
        lease = ReadLease(self.storage, step, key, holder)
        try:
            self._check(step)
        except BaseException:
            lease.release()
            raise
        _RENEWER.add(lease)
        return lease

    def _check(self, step: int) -> None:
        """After the lease is written: no deletion of ``step`` under way, and ``step`` committed."""
        marker = f"{self._dir(step)}/{DELETING_NAME}"
        deadline = time.monotonic() + _DELETING_WAIT_S
        while self.storage.exists(marker) and self._deletion_live(step, marker):
            if time.monotonic() >= deadline:
                raise CheckpointNotFoundError(
                    f"step {step} in {self.storage.uri} is being deleted by retention ({marker} is there)"
                )
            time.sleep(0.02)
        self._check_committed(step)

    def _deletion_live(self, step: int, marker: str) -> bool:
        """Whether the deletion record ``marker`` belongs to a retention pass that may still delete. A pass
        killed before it removed its record (its process gone on this host, or the record older than its time
        to live) deletes nothing more; whether it un-committed the step is for the commit check that follows,
        so readers of a step it left committed are not refused until the next pass cleans the record up."""
        now = time.time()
        return any(key == marker and self._is_live(key, mtime, now) for key, mtime in self._records(self._dir(step)))

    def _check_committed(self, step: int) -> None:
        if not self.storage.exists(f"{step_dirname(step)}/{MANIFEST_NAME}"):
            raise CheckpointNotFoundError(
                f"no checkpoint of step {step} in {self.storage.uri}: it was deleted before it could be read"
            )

    def _warn_unleased(self, exc: StorageError) -> None:
        if self.storage.uri in _WARNED:
            return
        _WARNED.add(self.storage.uri)
        warnings.warn(
            f"cannot write read leases in {self.storage.uri} ({exc}); reading without one: a writer's retention "
            "may delete a checkpoint while it is read (the read then fails with CheckpointNotFoundError)",
            TiersaveWarning,
            stacklevel=4,
        )

    # -- retention --------------------------------------------------------------------------------

    @contextmanager
    def deleting(self, step: int) -> Iterator[bool]:
        """Retention's side: put the deletion record of ``step``, then read its leases. Yields True when no
        live lease holds it (delete it inside the ``with``), False to keep it; the record goes on exit."""
        holder = LockHolder.mine(float(read_lease_ttl_s()))
        marker = f"{self._dir(step)}/{DELETING_NAME}"
        started = time.monotonic()
        try:
            _put(self.storage, marker, holder.to_bytes(), "overwrite")
        except NoSpaceError as exc:
            # Retention is what frees a full root: it goes on, still keeping the steps leased now; readers of
            # a full root cannot write leases either and read without (both warned), as before leases.
            log.warning(
                "tiersave: retention in %s deletes step %d without a deletion record: %s", self.storage.uri, step, exc
            )
        try:
            held = self.live(step)
            if held:
                log.info("retention in %s keeps step %d: %d reader(s) hold a lease on it", self.storage.uri, step, held)
            # Readers wait out a deletion record, but the cleanup of another process takes one this old
            # for a dead deleter's: un-commit well within its life or not at all.
            yield not held and time.monotonic() - started < holder.ttl_s / 2
        finally:
            self.storage.delete(marker)

    def live(self, step: int) -> int:
        """How many live read leases hold ``step``."""
        now = time.time()
        count = 0
        for key, mtime in self._records(self._dir(step)):
            if key.rsplit("/", 1)[-1] != DELETING_NAME and self._is_live(key, mtime, now):
                count += 1
        return count

    def leased(self) -> dict[int, int]:
        """Step -> how many live read leases hold it (a ``tiersave ls`` view)."""
        now = time.time()
        out: dict[int, int] = {}
        for key, mtime in self._records(LEASES_PREFIX):
            step = parse_step_dirname(key.split("/")[1])
            if step is not None and key.rsplit("/", 1)[-1] != DELETING_NAME and self._is_live(key, mtime, now):
                out[step] = out.get(step, 0) + 1
        return out

    def clean(self, committed: Callable[[], Collection[int]]) -> list[str]:
        """Remove expired lease and deletion records (dead readers, interrupted deletions), and the lease
        directories of steps no longer committed once they hold nothing (``committed()`` is asked after the
        records are listed, so a step committed meanwhile keeps its readers' leases); returns the keys
        removed."""
        now = time.time()
        removed: list[str] = []
        occupied: set[str] = set()
        for key, mtime in self._records(LEASES_PREFIX):
            if self._is_live(key, mtime, now):
                occupied.add(key.split("/")[1])
                continue
            self.storage.delete(key)
            removed.append(key)
        if not self.storage.capabilities.atomic_rename:
            return removed  # an object store has no empty directories to remove
        try:
            names = [n for n in self.storage.list_dirs(LEASES_PREFIX) if n not in occupied]
        except ObjectNotFoundError:
            names = []
        held = set(committed()) if names else set()
        for name in names:
            step = parse_step_dirname(name)
            if step is not None and step not in held:
                try:
                    self.storage.delete_prefix(f"{LEASES_PREFIX}/{name}")
                except AlreadyExistsError:  # not empty: a reader's lease landed meanwhile; a later pass removes it
                    continue
        return removed

    def _records(self, prefix: str) -> Iterator[tuple[str, float]]:
        """``(key, mtime)`` of the lease and deletion records under ``prefix`` (temporary files of a put in
        progress, deeper keys and other names are not records)."""
        try:
            found = [(obj.key, obj.mtime) for obj in self.storage.list(prefix)]
        except ObjectNotFoundError:
            return
        for key, mtime in found:
            parts = key.split("/")
            if len(parts) != 3 or parts[0] != LEASES_PREFIX or parse_step_dirname(parts[1]) is None:
                continue
            if parts[2] == DELETING_NAME or (parts[2].startswith("read-") and parts[2].endswith(".json")):
                yield key, mtime

    def _is_live(self, key: str, mtime: float, now: float) -> bool:
        """Whether a record still holds: written (by the storage's clock) less than its time to live ago and,
        when its holder ran on this host, that process still running. A record that cannot be read as one
        (too large, not JSON, not a regular file) holds for this process's time to live: the safe side, and
        never for ever."""
        try:
            holder = LockHolder.parse(self.storage.get(key, max_bytes=MAX_LOCK_BYTES))
        except ObjectNotFoundError:
            return False  # released meanwhile
        except (FormatError, StorageError):
            holder = None
        if holder is None:
            ttl = float(read_lease_ttl_s())
            log.warning(
                "tiersave: %s in %s is not a lease record; it holds until %.0f s after it was written",
                key,
                self.storage.uri,
                ttl,
            )
        elif holder.alive() is False:
            return False
        else:
            ttl = min(max(holder.ttl_s, 1.0), MAX_TTL_S)
        age = now - mtime
        if age < -(ttl + _SLACK_S):  # dated further ahead than its whole life: a forged time or a broken clock
            log.warning("tiersave: %s in %s is dated %.0f s in the future; ignored", key, self.storage.uri, -age)
            return False
        return age < ttl + _SLACK_S
