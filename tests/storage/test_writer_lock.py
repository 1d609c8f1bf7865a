"""One writer per root: a second live writer is refused naming the holder; a dead writer's lock is taken over.

Real processes (a writer in a child process, killed with SIGKILL where the test needs a dead writer), the
real file system, /dev/shm and the real SeaweedFS S3 server. Every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import tiersave
from tiersave.errors import PreconditionFailedError, StorageError, WriterLockedError
from tiersave.storage.lock import LOCK_NAME, LockHolder
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.s3.errors import map_s3_error
from tiersave.storage.s3.lease import Lease

SRC = str(Path(__file__).resolve().parents[2] / "src")

# The child saves step 1, writes READY, and stays alive (holding the lock) until killed or told to close.
_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch, tiersave
    root, ready, done = sys.argv[1], sys.argv[2], sys.argv[3]
    ckpt = tiersave.Checkpointer(root, handle_sigterm=False)
    ckpt.save(1, {"w": torch.ones(4)})
    open(ready, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    ckpt.close()
    """
)


class Writer:
    """A writer process holding ``root``'s lock until :meth:`finish` or :meth:`kill`."""

    def __init__(self, root: str, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.ready, self.done = tmp / f"ready-{id(self)}", tmp / f"done-{id(self)}"
        full_env = {**os.environ, **(env or {}), "PYTHONPATH": SRC}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, root, str(self.ready), str(self.done)],
            env=full_env,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait(timeout=30)
                err = self.proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
                self._close_pipe()
                raise AssertionError(f"the writer did not start: {err}")
            time.sleep(0.05)

    def finish(self) -> None:
        self.done.touch()
        code = self.proc.wait(timeout=60)
        self._close_pipe()
        assert code == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._close_pipe()

    def _close_pipe(self) -> None:
        """The stderr pipe, once the process ended (left open, the garbage collector closed it later with a
        ResourceWarning in whichever test ran then)."""
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            self.proc.stderr.close()


@pytest.fixture
def cleanup() -> Any:
    writers: list[Writer] = []
    yield writers
    for w in writers:
        w.kill()


def state() -> dict[str, Any]:
    return {"w": torch.zeros(4)}


def test_second_writer_in_another_process_is_refused_naming_the_holder(root, tmp_path, cleanup):
    w = Writer(str(root), tmp_path)
    cleanup.append(w)
    with tiersave.Checkpointer(root) as ckpt:
        with pytest.raises(WriterLockedError) as err:
            ckpt.save(2, state())
        message = str(err.value)
        assert f"pid {w.proc.pid}" in message and socket.gethostname() in message and "since" in message
        assert err.value.holder is not None and err.value.holder["pid"] == w.proc.pid
        assert ckpt.list()[-1].step == 1  # nothing of the refused save is visible
        # a reader never takes the lock: restoring while the writer lives works
        assert torch.equal(ckpt.restore()["w"], torch.ones(4))
    w.finish()
    with tiersave.Checkpointer(root) as ckpt, warnings.catch_warnings():  # released: no note for the next writer
        warnings.simplefilter("error")
        ckpt.save(2, state())
    assert (root / LOCK_NAME).read_bytes() == b""  # a clean release empties the lock file


def test_second_checkpointer_in_the_same_process_is_refused(root):
    first = tiersave.Checkpointer(root)
    first.save(1, state())
    second = tiersave.Checkpointer(root)
    with pytest.raises(WriterLockedError, match=f"pid {os.getpid()}"):
        second.save(2, state())
    with pytest.raises(WriterLockedError):
        second.prune(keep_last=1)  # retention is writing too
    first.close()
    second.save(2, state())
    second.close()
    assert [i.step for i in tiersave.Checkpointer(root).list()] == [1, 2]


def test_lock_of_a_killed_writer_is_taken_over_with_a_note(root, tmp_path, cleanup, caplog):
    w = Writer(str(root), tmp_path)
    cleanup.append(w)
    w.kill()
    with tiersave.Checkpointer(root) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("error")  # a note in the log, not a Python warning: resuming is the normal path
        ckpt.save(2, state())
        holder = LockHolder.parse((root / LOCK_NAME).read_bytes())
        assert holder is not None and holder.pid == os.getpid()
    note = f"took over the writer lock of {root.as_uri()} left by pid {w.proc.pid}"
    assert note in caplog.text and "that process is no longer running" in caplog.text


def test_opt_outs(root, monkeypatch):
    with tiersave.Checkpointer(root) as a, tiersave.Checkpointer(root, writer_lock=False) as b:
        a.save(1, state())
        b.save(2, state())
    monkeypatch.setenv("TIERSAVE_WRITER_LOCK", "0")
    with tiersave.Checkpointer(root) as a, tiersave.Checkpointer(root) as b:
        a.save(3, state())
        b.save(4, state())


def test_lock_file_is_opened_like_any_file_of_the_root(root, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.write_bytes(b"")
    (root / LOCK_NAME).symlink_to(outside)
    with tiersave.Checkpointer(root) as ckpt, pytest.raises(tiersave.FormatError, match="symbolic link"):
        ckpt.save(1, state())
    assert outside.read_bytes() == b""


def test_every_tier_is_locked_memory_included(tmp_path, cleanup, monkeypatch):
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(tmp_path / "shm"))
    name = f"lock-{os.getpid()}"
    disk = tmp_path / "disk"
    tiers = [f"mem://{name}", str(disk)]
    try:
        with tiersave.Checkpointer(tiers=tiers) as a:
            a.save(1, state())
            # another writer on the memory tier alone, or on the disk tier alone, is refused
            for other in ([f"mem://{name}"], [str(disk)]):
                with tiersave.Checkpointer(tiers=other) as b, pytest.raises(WriterLockedError):
                    b.save(2, state())
    finally:
        MemoryStorage(name).destroy()


# -- object stores: the lease --------------------------------------------------------------------------


@pytest.fixture
def s3_root(seaweed, s3_bucket, monkeypatch) -> Any:
    """(URI, storage) of a fresh prefix; the AWS_* environment points at the test server."""
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    storage = seaweed.storage(s3_bucket, "run")  # creates the bucket
    yield seaweed.uri(s3_bucket, "run"), storage
    storage.close()


def test_s3_second_writer_is_refused_and_release_deletes_the_lease(s3_root, tmp_path, cleanup):
    s3_uri, storage = s3_root
    w = Writer(s3_uri, tmp_path, {"TIERSAVE_LEASE_TTL_S": "3"})
    cleanup.append(w)
    holder = LockHolder.parse(storage.get(LOCK_NAME))
    assert holder is not None and holder.pid == w.proc.pid and holder.ttl_s == 3
    started = time.monotonic()
    with pytest.raises(WriterLockedError, match=f"pid {w.proc.pid}.*renewing its lease"):
        Lease(storage)  # watched until its writer's next heartbeat shows it alive
    assert time.monotonic() - started < 15  # bounded (the message shows it saw a renewal, not an expiry)
    w.finish()
    assert not storage.exists(LOCK_NAME)
    Lease(storage).release()


def test_s3_lease_of_a_killed_writer_expires_and_is_taken_over(s3_root, tmp_path, cleanup):
    s3_uri, storage = s3_root
    w = Writer(s3_uri, tmp_path, {"TIERSAVE_LEASE_TTL_S": "2"})
    cleanup.append(w)
    # same host, dead pid: stale at once, no need to wait for the expiry
    w.kill()
    lease = Lease(storage, ttl_s=2)
    assert lease.note is not None and f"pid {w.proc.pid}" in lease.note and "no longer running" in lease.note
    lease.release()
    # another host's lease is judged by its renewals only: forged here with a host name that is not ours, it
    # is never renewed, so a new writer waits out its time to live and takes it over (a job restarted on
    # another node right after its predecessor died goes on instead of failing)
    other = LockHolder("elsewhere.invalid", 4242, time.time(), "t" * 16, time.time(), 2.0)
    storage.put(LOCK_NAME, other.to_bytes())
    started = time.monotonic()
    lease = Lease(storage, ttl_s=2)
    assert 1.5 < time.monotonic() - started < 8
    assert lease.note is not None and "elsewhere.invalid" in lease.note and "not renewed" in lease.note
    lease.release()


def test_s3_heartbeat_renews_and_a_lost_lease_refuses_the_next_save(s3_root, monkeypatch):
    s3_uri, _ = s3_root
    monkeypatch.setenv("TIERSAVE_LEASE_TTL_S", "2")
    ckpt = tiersave.Checkpointer(s3_uri)
    ckpt.save(1, state())
    first = ckpt.storage.head(LOCK_NAME).mtime
    time.sleep(2.5)  # past its time to live: alive only because the heartbeat renewed it
    assert ckpt.storage.head(LOCK_NAME).mtime > first
    with pytest.raises(WriterLockedError):
        Lease(ckpt.storage, ttl_s=2)
    # a successor's lease replaces ours (as after a pause longer than the lease): the next save is refused
    successor = LockHolder("elsewhere.invalid", 4242, time.time(), "s" * 16, time.time(), 2.0)
    # written once: a renewal that read our lease just before replaces only that version (If-Match), so
    # the successor's lease stays whenever it lands
    ckpt.storage.put(LOCK_NAME, successor.to_bytes())
    time.sleep(1.5)  # two heartbeats (every third of the 2 s time to live) read it back
    assert LockHolder.parse(ckpt.storage.get(LOCK_NAME)) == successor
    with pytest.raises(WriterLockedError, match=r"taken over by pid 4242 on host elsewhere\.invalid"):
        ckpt.save(2, state())
    ckpt.close()
    assert LockHolder.parse(ckpt.storage.get(LOCK_NAME)) == successor  # close never deletes another's lease


def _wait_lost(lease: Lease, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            lease.check()
        except WriterLockedError as exc:
            return str(exc)
        time.sleep(0.05)
    raise AssertionError(f"the lease was not found lost within {seconds} s")


def test_s3_a_renewal_never_overwrites_a_successor_written_after_its_read(s3_root, monkeypatch):
    _, storage = s3_root
    lease = Lease(storage, ttl_s=2)
    assert lease.conditional  # SeaweedFS honours If-Match
    successor = LockHolder("elsewhere.invalid", 4242, time.time(), "s" * 16, time.time(), 60.0)
    read = storage.get_version
    armed = [True]

    def read_then_successor(key: str, **kw: Any) -> Any:
        got = read(key, **kw)  # the heartbeat's read of its own lease...
        if armed[0] and key == LOCK_NAME:
            armed[0] = False
            storage.put(LOCK_NAME, successor.to_bytes())  # ...and a successor's lease before its renewal
        return got

    monkeypatch.setattr(storage, "get_version", read_then_successor)
    message = _wait_lost(lease, 5.0)
    assert re.search(r"taken over by pid 4242 on host elsewhere\.invalid .*as this writer renewed it", message)
    assert LockHolder.parse(storage.get(LOCK_NAME)) == successor  # never overwritten
    lease.release()
    assert LockHolder.parse(storage.get(LOCK_NAME)) == successor  # nor deleted


def test_s3_a_stale_lease_is_taken_over_by_one_successor_only(s3_root, monkeypatch):
    _, storage = s3_root
    stale = LockHolder("gone.invalid", 4242, time.time(), "g" * 16, time.time(), 2.0)
    rival = LockHolder("rival.invalid", 4343, time.time(), "r" * 16, time.time(), 2.0)
    storage.put(LOCK_NAME, stale.to_bytes())
    read = storage.get_version

    def read_then_rival(key: str, **kw: Any) -> Any:
        got = read(key, **kw)
        if key == LOCK_NAME and LockHolder.parse(got.data) == stale:
            # this read finds the lease expired, and a rival successor replaces that version first
            storage.put_if_version(LOCK_NAME, rival.to_bytes(), got.version)
        return got

    time.sleep(3.5)  # expired (2 s time to live, + 1 s for Last-Modified's resolution) before the first read
    monkeypatch.setattr(storage, "get_version", read_then_rival)
    lease = Lease(storage, ttl_s=2)
    # the rival's lease was not deleted under it: this writer read it again, and took it over only once it
    # expired in turn (the rival never renews it)
    assert lease.note is not None and "rival.invalid" in lease.note and "not renewed" in lease.note
    assert LockHolder.parse(storage.get(LOCK_NAME)) == lease.holder
    lease.release()


def test_s3_a_store_without_if_match_is_renewed_by_overwrite_with_a_warning(s3_root, monkeypatch, caplog):
    _, storage = s3_root

    def ignores_if_match(key: str, data: Any, version: str) -> None:
        storage.put(key, data)  # as a store that ignores the header: an unconditional overwrite

    monkeypatch.setattr(storage, "put_if_version", ignores_if_match)
    with caplog.at_level("WARNING", logger="tiersave.storage.s3.lease"):
        lease = Lease(storage, ttl_s=2)
    assert not lease.conditional and "ignores If-Match" in caplog.text
    assert [o.key for o in storage.list()] == [LOCK_NAME]  # the probe's scratch object is gone
    first = storage.head(LOCK_NAME).mtime
    time.sleep(2.5)  # past its time to live: alive only because the heartbeat renewed it
    assert storage.head(LOCK_NAME).mtime > first
    lease.check()
    lease.release()
    assert not storage.exists(LOCK_NAME)
    # a stale lease on such a store is deleted and created anew (create-only), with the note
    stale = LockHolder("gone.invalid", 4242, time.time(), "g" * 16, time.time(), 2.0)
    storage.put(LOCK_NAME, stale.to_bytes())
    time.sleep(3.5)
    lease = Lease(storage, ttl_s=2)
    assert lease.note is not None and "gone.invalid" in lease.note
    assert LockHolder.parse(storage.get(LOCK_NAME)) == lease.holder
    lease.release()

    def refuses_if_match(key: str, data: Any, version: str) -> None:
        raise StorageError("HTTP 501 NotImplemented", tier=storage.uri, key=key)

    monkeypatch.setattr(storage, "put_if_version", refuses_if_match)
    caplog.clear()
    with caplog.at_level("WARNING", logger="tiersave.storage.s3.lease"):
        lease = Lease(storage, ttl_s=2)
    assert not lease.conditional and "refuses conditional writes" in caplog.text
    lease.release()
    assert list(storage.list()) == []

    from tiersave.errors import TransientStorageError

    def not_implemented(key: str, data: Any, version: str) -> None:  # as errors.py maps an answer of 501
        raise map_s3_error(RuntimeError("HTTP status 501 NotImplemented"), tier=storage.uri, key=key, action="writing")

    monkeypatch.setattr(storage, "put_if_version", not_implemented)
    lease = Lease(storage, ttl_s=2)
    assert not lease.conditional
    lease.release()

    def times_out(key: str, data: Any, version: str) -> None:
        raise TransientStorageError("writing failed: operation timed out", tier=storage.uri, key=key)

    # no evidence about If-Match: the lock is not weakened for good, the error goes to the caller
    monkeypatch.setattr(storage, "put_if_version", times_out)
    with pytest.raises(TransientStorageError, match="timed out"):
        Lease(storage, ttl_s=2)
    assert list(storage.list()) == []  # neither a lease nor the probe's scratch object


def test_s3_a_lease_released_and_taken_while_a_successor_waits_is_not_deleted(s3_root, monkeypatch):
    _, storage = s3_root
    live = LockHolder("live.invalid", 4242, time.time(), "l" * 16, time.time(), 2.0)
    third = LockHolder("third.invalid", 4343, time.time(), "t" * 16, time.time(), 2.0)
    storage.put(LOCK_NAME, live.to_bytes())  # fresh: the new writer watches it
    read = storage.get_version
    reads = [0]

    def released_then_third(key: str, **kw: Any) -> Any:
        if key == LOCK_NAME:
            reads[0] += 1
            if reads[0] == 2:  # the watching writer's second look: released, and a third writer creates it
                storage.delete(LOCK_NAME)
                try:
                    return read(key, **kw)
                finally:
                    storage.put(LOCK_NAME, third.to_bytes(), mode="create")
        return read(key, **kw)

    monkeypatch.setattr(storage, "get_version", released_then_third)
    lease = Lease(storage, ttl_s=2)
    # the third writer's lease was read and waited out, not deleted on sight
    assert lease.note is not None and "third.invalid" in lease.note and "not renewed" in lease.note
    lease.release()


def test_s3_a_takeover_whose_outcome_is_unknown_deletes_nothing(s3_root, monkeypatch):
    from tiersave.errors import TransientStorageError

    _, storage = s3_root
    stale = LockHolder("gone.invalid", 4242, time.time(), "g" * 16, time.time(), 2.0)
    storage.put(LOCK_NAME, stale.to_bytes())
    time.sleep(3.5)
    conditional = storage.put_if_version

    def times_out(key: str, data: Any, version: str) -> None:
        if key != LOCK_NAME:
            return conditional(key, data, version)  # the probe
        raise TransientStorageError("connection reset", tier=storage.uri, key=key)

    monkeypatch.setattr(storage, "put_if_version", times_out)
    with pytest.raises(TransientStorageError):
        Lease(storage, ttl_s=2)
    assert LockHolder.parse(storage.get(LOCK_NAME)) == stale  # not deleted on a guess


def test_s3_a_renewal_the_store_refuses_is_not_counted_and_the_save_is_refused(s3_root, monkeypatch):
    _, storage = s3_root
    lease = Lease(storage, ttl_s=2)
    assert lease.conditional

    def refuses(key: str, data: Any, version: str) -> None:
        raise PreconditionFailedError("412", tier=storage.uri, key=key)  # yet the lease is still ours

    monkeypatch.setattr(storage, "put_if_version", refuses)
    message = _wait_lost(lease, 6.0)
    assert re.search(r"could not be renewed|past its time to live", message), message
    assert LockHolder.parse(storage.get(LOCK_NAME)).token == lease.holder.token  # ours, never renewed
    lease.release()


def test_s3_a_save_is_refused_once_the_lease_went_unrenewed_for_its_time_to_live(s3_root, monkeypatch):
    _, storage = s3_root
    lease = Lease(storage, ttl_s=2)
    gate = threading.Event()
    read = storage.get_version

    def hangs(key: str, **kw: Any) -> Any:
        if key == LOCK_NAME:
            gate.wait(20)  # a request that neither answers nor fails (bounded here)
        return read(key, **kw)

    monkeypatch.setattr(storage, "get_version", hangs)
    try:
        message = _wait_lost(lease, 6.0)
        assert "past its time to live" in message
    finally:
        gate.set()
        lease.release()


def test_malformed_lock_contents_name_no_holder():
    assert LockHolder.parse(b"") is None
    assert LockHolder.parse(b"x" * 5000) is None
    assert LockHolder.parse(b'{"host": "h", "pid": true, "since": 1, "token": "t"}') is None
    assert LockHolder.parse(b"[" * 10000) is None
    h = LockHolder.mine(5)
    assert LockHolder.parse(h.to_bytes()) == h
