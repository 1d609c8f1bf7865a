"""Read leases in one process, with the real file system: the order of the lease and the deletion record closes
the race between a reader choosing a step and retention deleting it (every interleaving below is forced with a
hook at the storage call where it happens), hostile lease files neither stop retention nor pin a step for ever,
expiry and renewal, and a root where no lease can be written. The same protocol between real processes, on
``mem://`` and S3 too: tests/storage/test_read_leases.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.errors import CheckpointNotFoundError, StorageError, TiersaveWarning, storage_error_from_os
from tiersave.export import export_safetensors
from tiersave.format.layout import step_dirname
from tiersave.leases import LEASES_PREFIX, LeaseStore
from tiersave.storage.lock import LockHolder
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import Fault, FaultyStorage

TTL = 3  # a deletion pass must write its record and read the leases within TTL/2, even on a loaded CI


@pytest.fixture(autouse=True)
def short_ttl(monkeypatch):
    monkeypatch.setenv("TIERSAVE_READ_LEASE_TTL_S", str(TTL))


def state(step: int) -> dict:
    return {"w": torch.full((1024,), float(step))}


def saved(root: Path, steps: range) -> None:
    with tiersave.Checkpointer(root) as writer:
        for step in steps:
            writer.save(step, state(step))


def prune(root: Path) -> list[int]:
    """Another process's retention keeping one checkpoint (``tiersave prune ROOT --keep-last 1``)."""
    return Catalog(LocalStorage(root)).prune(keep_last=1).deleted


class Hooked(FaultyStorage):
    """A real storage that runs ``hook`` once, right after the first call of ``op`` on a key containing ``key``."""

    def __init__(self, inner, op: str, key: str, hook: Callable[[], None], *, before: bool = False) -> None:
        super().__init__(inner)
        self._op, self._key, self._hook, self._before = op, key, hook, before

    def _fire(self, op: str, key: str) -> None:
        if op == self._op and self._key in key and self._hook is not None:
            hook, self._hook = self._hook, None
            hook()

    def put(self, key, data, *, mode="overwrite"):
        if self._before:
            self._fire("put", key)
        super().put(key, data, mode=mode)
        if not self._before:
            self._fire("put", key)

    def rename_prefix(self, src, dst):
        if self._before:
            self._fire("rename_prefix", src)
        super().rename_prefix(src, dst)
        if not self._before:
            self._fire("rename_prefix", src)


def lease_files(root: Path) -> list[str]:
    top = root / LEASES_PREFIX
    return sorted(str(p.relative_to(top)) for p in top.rglob("*") if p.is_file()) if top.exists() else []


def read(how: str, storage, tmp_path: Path) -> None:
    if how == "restore":
        with tiersave.Checkpointer(storage) as reader:
            reader.restore(1)
    else:
        export_safetensors(Catalog(storage), 1, tmp_path / "out.safetensors")


# -- the race, one interleaving at a time ------------------------------------------------------------


@pytest.mark.parametrize("how", ["restore", "export", "verify"])
def test_a_step_deleted_between_the_readers_choice_and_its_lease_is_not_found_never_corrupt(root, tmp_path, how):
    saved(root, range(1, 3))
    # the reader chose step 1; retention (another process) deletes it just before the reader's lease is written
    storage = Hooked(LocalStorage(root), "put", f"{LEASES_PREFIX}/", lambda: prune(root), before=True)
    if how == "verify":
        report = Catalog(storage).verify(1)
        assert not report.ok
        assert report.errors == [f"no checkpoint of step 1 in {storage.uri}: it was deleted before it could be read"]
    else:
        with pytest.raises(CheckpointNotFoundError, match=r"step 1 .*deleted"):
            read(how, storage, tmp_path)
    assert Catalog(LocalStorage(root)).steps() == [2]
    assert lease_files(root) == []  # the reader dropped its lease


def test_a_lease_written_before_retention_reads_the_leases_keeps_the_step(root):
    saved(root, range(1, 3))
    reader = Catalog(LocalStorage(root))
    opened: list = []

    def reader_takes_its_lease() -> None:
        # retention has written its deletion record; a reader writes its lease now, in another thread, and
        # waits for the record to go before it checks the commit
        thread = threading.Thread(target=lambda: opened.append(reader.open(1)))
        thread.start()
        deadline = time.monotonic() + 10
        while not any(name.startswith("step-0000000001/read-") for name in lease_files(root)):
            assert time.monotonic() < deadline, "the reader wrote no lease"
            time.sleep(0.005)
        threads.append(thread)

    threads: list[threading.Thread] = []
    writer = Catalog(Hooked(LocalStorage(root), "put", "deleting.json", reader_takes_its_lease))
    assert writer.prune(keep_last=1).deleted == []  # it saw the lease: step 1 stays
    threads[0].join(timeout=10)
    with opened[0] as ckpt:  # the reader goes on: the step is whole
        assert ckpt.step == 1
        assert Catalog(LocalStorage(root)).verify(1).ok
    assert prune(root) == [1]  # the lease dropped: the next retention pass deletes it
    assert lease_files(root) == []


def test_a_lease_written_after_retention_read_the_leases_finds_the_step_gone(root):
    saved(root, range(1, 3))
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []

    def reader_arrives_during_the_delete() -> None:
        def read() -> None:
            try:
                Catalog(LocalStorage(root)).open(1)
            except BaseException as exc:
                errors.append(exc)

        threads.append(threading.Thread(target=read))
        threads[0].start()
        time.sleep(0.2)  # the reader's lease is written while the step is being deleted

    writer = Catalog(Hooked(LocalStorage(root), "rename_prefix", "step-0000000001", reader_arrives_during_the_delete))
    assert writer.prune(keep_last=1).deleted == [1]
    threads[0].join(timeout=10)
    assert len(errors) == 1 and isinstance(errors[0], CheckpointNotFoundError), errors
    assert lease_files(root) == []


def test_a_lease_write_that_fails_after_the_lease_landed_leaves_no_lease(root, monkeypatch):
    """Retention (another process) deletes the step this reader chose, then empties the step's lease folder while
    the reader writes its lease there: it unlinks the temporary file it listed right after the reader linked it to
    the lease's name, so the write fails although the lease is there. The reader finds the step gone and must not
    leave that lease behind: renewed by no one, it would hold the step for a time to live."""
    saved(root, range(1, 3))
    real_link = os.link

    def link(src, dst, *, src_dir_fd=None, dst_dir_fd=None, follow_symlinks=True):
        real_link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)
        if str(dst).startswith("read-"):
            os.unlink(src, dir_fd=src_dir_fd)  # retention's removal of the lease folder, listed before the link

    monkeypatch.setattr(os, "link", link)
    storage = Hooked(LocalStorage(root), "put", f"{LEASES_PREFIX}/", lambda: prune(root), before=True)
    with pytest.raises(CheckpointNotFoundError, match=r"step 1 .*deleted"):
        Catalog(storage).open(1)
    assert Catalog(LocalStorage(root)).leases.leased() == {}
    assert lease_files(root) == []


def test_a_lease_write_that_fails_after_the_lease_landed_on_a_committed_step_leaves_no_lease(root):
    """An object store's PUT that landed but whose reply was lost: the read fails with the storage error, and the
    lease it wrote does not stay behind."""

    class LandsThenFails(FaultyStorage):
        def put(self, key, data, *, mode="overwrite"):
            super().put(key, data, mode=mode)
            if key.startswith(f"{LEASES_PREFIX}/"):
                raise storage_error_from_os(
                    OSError(errno.ETIMEDOUT, "reply lost"), tier=self.uri, key=key, action="put"
                )

    saved(root, range(1, 3))
    with pytest.raises(StorageError, match="reply lost"):
        Catalog(LandsThenFails(LocalStorage(root))).open(1)
    assert Catalog(LocalStorage(root)).leases.leased() == {}
    assert lease_files(root) == []


def test_a_create_only_put_whose_temporary_was_removed_after_the_link_succeeds(root, monkeypatch):
    """The object is written once the link lands; a removal of the folder's contents that took the temporary file
    too (retention emptying a lease folder) does not make the write report a failure."""
    real_link = os.link

    def link(src, dst, *, src_dir_fd=None, dst_dir_fd=None, follow_symlinks=True):
        real_link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)
        os.unlink(src, dir_fd=src_dir_fd)

    storage = LocalStorage(root)
    monkeypatch.setattr(os, "link", link)
    storage.put("dir/record.json", b"{}", mode="create")
    assert storage.get("dir/record.json") == b"{}"
    assert sorted(p.name for p in (root / "dir").iterdir()) == ["record.json"]


def test_retention_goes_on_when_a_lease_lands_in_a_folder_it_is_removing(root, monkeypatch):
    """A reader's lease written into a deleted step's lease folder while retention removes that folder: the
    folder stays (with the lease, which keeps or expires as any other) and the retention pass completes."""
    saved(root, range(1, 3))
    folder = root / LEASES_PREFIX / step_dirname(1)
    folder.mkdir(parents=True)  # left by an interrupted pass: step 1 is deleted below
    real_rmdir = os.rmdir

    def rmdir(path, *, dir_fd=None):
        if path == folder.name and folder.exists() and not any(folder.iterdir()):
            (folder / "read-lease.json").write_text("{}")  # the reader's link, after the folder was listed
        real_rmdir(path, dir_fd=dir_fd)

    monkeypatch.setattr(os, "rmdir", rmdir)
    assert prune(root) == [1]
    assert (folder / "read-lease.json").exists()
    assert Catalog(LocalStorage(root)).steps() == [2]


def test_a_dry_run_of_retention_does_not_list_a_leased_step(root):
    saved(root, range(1, 4))
    catalog = Catalog(LocalStorage(root))
    with Catalog(LocalStorage(root)).open(1):
        assert catalog.prune(keep_last=1, dry_run=True).deleted == [2]
    assert catalog.prune(keep_last=1, dry_run=True).deleted == [1, 2]


def test_a_deletion_record_left_by_a_killed_retention_does_not_refuse_readers_of_a_step_it_left_committed(root):
    # Retention killed between writing its deletion record and un-committing the step: the step is whole
    # and committed, and its readers must not be told it is being deleted (a reader waits only for a live
    # record's owner).
    saved(root, range(1, 3))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    holder = dataclasses.replace(LockHolder.mine(float(TTL)), pid=dead.pid)
    marker = root / LEASES_PREFIX / "step-0000000001" / "deleting.json"
    marker.parent.mkdir(parents=True)
    marker.write_bytes(holder.to_bytes())
    with Catalog(LocalStorage(root)).open(1) as ckpt:
        assert ckpt.step == 1
    marker.write_bytes(LockHolder.mine(float(TTL)).to_bytes())  # a live retention pass (this process)
    with pytest.raises(CheckpointNotFoundError, match="being deleted by retention"):
        Catalog(LocalStorage(root)).open(1)


# -- expiry, renewal, a dead reader ------------------------------------------------------------------


def test_a_held_lease_is_renewed_past_its_time_to_live_and_retention_keeps_the_step(root):
    saved(root, range(1, 3))
    with Catalog(LocalStorage(root)).open(1):
        time.sleep(2.5 * TTL)  # renewed every TTL/3
        assert prune(root) == []
        assert Catalog(LocalStorage(root)).verify(1).ok
    assert prune(root) == [1]


def test_a_lease_with_a_shorter_time_to_live_than_those_held_is_renewed_on_its_own_schedule(root, monkeypatch):
    # The renewal thread sleeps until the next lease is due; a lease taken meanwhile with a shorter time to
    # live must wake it, or it expires while the thread sleeps out the longer leases' third.
    other = root.parent / "other"
    saved(other, range(1, 3))
    saved(root, range(1, 3))
    monkeypatch.setenv("TIERSAVE_READ_LEASE_TTL_S", "60")
    with Catalog(LocalStorage(other)).open(1):  # renewed every 20 s
        time.sleep(0.2)  # the thread is now asleep for 20 s
        monkeypatch.setenv("TIERSAVE_READ_LEASE_TTL_S", str(TTL))
        with Catalog(LocalStorage(root)).open(1):
            time.sleep(2.5 * TTL)
            assert prune(root) == []


def test_a_lease_not_renewed_expires_after_its_time_to_live(root):
    saved(root, range(1, 3))
    storage = LocalStorage(root)
    # a reader on another host that stopped renewing (this host cannot ask whether it lives)
    holder = LockHolder("elsewhere", 4242, time.time(), "t" * 16, time.time(), float(TTL))
    storage.put(f"{LEASES_PREFIX}/step-0000000001/read-elsewhere-4242-x.json", holder.to_bytes())
    assert prune(root) == []
    time.sleep(TTL + 1.5)
    assert prune(root) == [1]
    assert lease_files(root) == []  # the stale lease went with it


def test_a_lease_of_a_dead_process_of_this_host_holds_nothing(root):
    saved(root, range(1, 3))
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    holder = LockHolder(LockHolder.mine().host, pid, time.time(), "t" * 16, time.time(), 600.0)
    LocalStorage(root).put(f"{LEASES_PREFIX}/step-0000000001/read-here-{pid}-x.json", holder.to_bytes())
    assert prune(root) == [1]


# -- hostile lease files -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [b"not json", b"{" * 100, b"x" * 5000, json.dumps({"host": 1}).encode(), b""],
    ids=["garbage", "unbalanced", "oversized", "wrong-fields", "empty"],
)
def test_a_garbage_lease_holds_for_one_time_to_live_then_is_removed(root, content, caplog):
    saved(root, range(1, 3))
    (root / LEASES_PREFIX / "step-0000000001").mkdir(parents=True)
    (root / LEASES_PREFIX / "step-0000000001" / "read-forged.json").write_bytes(content)
    assert prune(root) == []  # the safe side: it may be a lease
    assert "is not a lease record" in caplog.text
    time.sleep(TTL + 1.5)
    assert prune(root) == [1]
    assert lease_files(root) == []


def test_a_lease_claiming_a_long_life_or_dated_in_the_future_does_not_pin(root):
    saved(root, range(1, 4))
    storage = LocalStorage(root)
    forever = LockHolder("elsewhere", 7, 0.0, "t" * 16, 0.0, 1e10)
    storage.put(f"{LEASES_PREFIX}/step-0000000001/read-a.json", forever.to_bytes())
    old = time.time() - 2 * 3600  # its life is capped at an hour
    os.utime(root / LEASES_PREFIX / "step-0000000001" / "read-a.json", (old, old))
    future = LockHolder("elsewhere", 7, 0.0, "t" * 16, 0.0, float(TTL))
    storage.put(f"{LEASES_PREFIX}/step-0000000002/read-b.json", future.to_bytes())
    ahead = time.time() + 10 * 365 * 86400
    os.utime(root / LEASES_PREFIX / "step-0000000002" / "read-b.json", (ahead, ahead))
    assert Catalog(storage).prune(keep_last=1).deleted == [1, 2]


def test_links_fifos_and_directories_in_the_lease_folder_are_not_leases(root, tmp_path):
    saved(root, range(1, 3))
    folder = root / LEASES_PREFIX / "step-0000000001"
    folder.mkdir(parents=True)
    target = tmp_path / "outside.json"
    target.write_bytes(LockHolder.mine(600.0).to_bytes())
    (folder / "read-link.json").symlink_to(target)
    os.mkfifo(folder / "read-fifo.json")
    (folder / "read-dir.json").mkdir()
    (folder / "read-dir.json" / "read-deep.json").write_bytes(LockHolder.mine(600.0).to_bytes())
    started = time.monotonic()
    assert prune(root) == [1]  # none of them pins step 1, and nothing blocks on the FIFO
    assert time.monotonic() - started < 10
    assert target.exists()  # the link's target is never touched


# -- a root where no lease can be written ------------------------------------------------------------


def test_a_root_where_no_lease_can_be_written_is_read_without_one_with_one_warning(root):
    saved(root, range(1, 3))
    refused = Fault("put", error=lambda: OSError(errno.EROFS, "Read-only file system"), persistent=True)
    storage = FaultyStorage(LocalStorage(root), [refused])
    reader = tiersave.Checkpointer(storage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(reader.restore(2)["w"], state(2)["w"])
        assert torch.equal(reader.restore(1)["w"], state(1)["w"])
        assert Catalog(storage).verify(2).ok
    notes = [w for w in caught if issubclass(w.category, TiersaveWarning) and "read leases" in str(w.message)]
    assert len(notes) == 1, [str(w.message) for w in caught]
    assert "reading without one" in str(notes[0].message)
    reader.close()


def test_retention_removes_the_lease_folders_of_deleted_steps(root):
    saved(root, range(1, 4))
    for step in (1, 2, 3):
        with Catalog(LocalStorage(root)).open(step):
            pass
    assert sorted(os.listdir(root / LEASES_PREFIX)) == ["step-0000000001", "step-0000000002", "step-0000000003"]
    assert prune(root) == [1, 2]
    assert sorted(os.listdir(root / LEASES_PREFIX)) == ["step-0000000003"]
    assert LeaseStore(LocalStorage(root)).leased() == {}


def test_a_reader_of_an_incremental_checkpoint_keeps_the_step_it_references(root):
    g = torch.Generator().manual_seed(0)
    state = {"base": torch.randn(2048, 1024, generator=g), "lora": torch.zeros(64, 64)}
    with tiersave.Checkpointer(root, incremental=True) as writer:
        writer.save(1, state)
        state["lora"] += 1
        writer.save(2, state)
    assert Catalog(LocalStorage(root)).manifest(2).referenced_steps == {1}
    with tiersave.Checkpointer(root) as writer:
        writer.save(3, {"other": torch.ones(8)})  # a full save: nothing references 1 or 2 any more
    with Catalog(LocalStorage(root)).open(2) as ckpt:  # its base weights are read from step 1's shard
        assert prune(root) == []  # both the step read and the step whose shards it reads stay
        assert sorted(Catalog(LocalStorage(root)).leases.leased()) == [1, 2]
        report = Catalog(LocalStorage(root)).verify(2)
        assert report.ok, report.errors
        assert ckpt.step == 2
    assert prune(root) == [1, 2]


def test_a_forked_child_never_removes_its_parents_lease(root):
    from tiersave.leases import _RENEWER

    saved(root, range(1, 3))
    with Catalog(LocalStorage(root)).open(1) as ckpt:
        pid = os.fork()
        if pid == 0:  # the child closes what it inherited and ends as an interpreter exit would
            try:
                ckpt.close()
                _RENEWER.release_all()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert [name for name in lease_files(root) if name.startswith("step-0000000001/read-")]
        assert prune(root) == []
    assert prune(root) == [1]


def test_a_reader_that_fails_to_close_still_releases_the_lease(root):
    """Closing an opened checkpoint releases its read lease even when closing a shard reader fails: otherwise the
    renewal thread would keep the step leased, and retention would never delete it, for the process's life."""
    saved(root, range(1, 3))
    catalog = Catalog(LocalStorage(root))
    ckpt = catalog.open(1)
    reader = ckpt.reader(0)

    def broken() -> None:
        raise OSError(errno.EIO, "close failed")

    reader.close = broken
    with pytest.raises(OSError, match="close failed"):
        ckpt.close()
    assert catalog.leases.leased() == {}
    assert prune(root) == [1]
