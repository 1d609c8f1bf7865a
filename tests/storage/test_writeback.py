"""Early writeback of buffered writes (storage/posix/writeback.py): each writer thread's run of consecutive
writes has its writeback started every ``TIERSAVE_WRITEBACK_BYTES``, a save's statistics count those bytes,
the final ``fsync`` stays, a platform without ``sync_file_range`` (or a file system refusing it) saves as
before, and an error it returns fails the save instead of being dropped."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import assert_same
from tiersave import Checkpointer
from tiersave.errors import ConfigError, StorageError
from tiersave.storage.posix import LocalStorage, writeback

MiB = 1 << 20


def _state(mib: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(mib)
    return {f"t{i}": torch.randn(MiB // 4 + 17 * i, generator=g) for i in range(mib)}


def _fsynced_inodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The inodes of the files and directories ``os.fsync`` is called on from now on (the real fsync runs)."""
    seen: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def _shard_inodes(root: Path, step: int) -> set[int]:
    return {p.stat().st_ino for p in root.glob(f"step-{step:010d}/*.bin")}


def test_one_thread_starts_a_range_every_step_and_fsyncs_at_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", str(4 * MiB))
    storage = LocalStorage(tmp_path, io="buffered")
    data = os.urandom(18 * MiB)
    writer = storage.open_writer("f")
    for off in range(0, len(data), MiB):  # the way a writer lane writes a chunk: 1 MiB pieces in order
        writer.write_at(off, memoryview(data)[off : off + MiB])
    assert writer.io_stats.writeback.calls == 4 and writer.io_stats.writeback.bytes == 16 * MiB
    fsynced = _fsynced_inodes(monkeypatch)
    ino = os.fstat(writer._fd).st_ino  # type: ignore[arg-type]
    writer.finish(len(data))
    assert fsynced == [ino]  # the last 2 MiB, never started early, are durable too: fsync unchanged
    assert (tmp_path / "f").read_bytes() == data
    assert storage.io_stats.to_json()["writeback"] == {
        "bytes": 16 * MiB,
        "seconds": pytest.approx(storage.io_stats.writeback.seconds, abs=1e-5),
        "calls": 4,
    }


def test_each_thread_follows_its_own_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads filling the two halves of one file, interleaved in time: each half is one run."""
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", str(4 * MiB))
    started: list[tuple[int, int]] = []
    real = writeback.sync_range
    assert real is not None, "Linux has sync_file_range"

    def record(fd: int, offset: int, nbytes: int, flags: int) -> int:
        started.append((offset, nbytes))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(writeback, "sync_range", record)
    storage = LocalStorage(tmp_path, io="buffered")
    data = os.urandom(16 * MiB)
    writer = storage.open_writer("f")
    turns = [threading.Semaphore(1), threading.Semaphore(0)]

    def lane(me: int, first: int) -> None:
        for off in range(first, first + 8 * MiB, MiB):
            turns[me].acquire()
            writer.write_at(off, memoryview(data)[off : off + MiB])
            turns[1 - me].release()

    threads = [threading.Thread(target=lane, args=(i, i * 8 * MiB)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    writer.finish(len(data))
    assert sorted(started) == [(0, 4 * MiB), (4 * MiB, 4 * MiB), (8 * MiB, 4 * MiB), (12 * MiB, 4 * MiB)]
    assert (tmp_path / "f").read_bytes() == data


def test_a_buffered_save_counts_its_early_writeback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", str(MiB))
    state = _state(12)
    fsynced = _fsynced_inodes(monkeypatch)
    with Checkpointer(LocalStorage(tmp_path, io="buffered"), event_log=False) as ck:
        handle = ck.save(1, state)
        assert handle.stats.extra.get("unstaged") is True
        early = handle.stats.extra["io"]["writeback"]
        # two writer lanes, each 6 MiB in order: at least 5 whole ranges each, never more than was written
        assert 10 * MiB <= early <= handle.stats.extra["io"]["buffered"]
        assert _shard_inodes(tmp_path, 1) <= set(fsynced)
        assert_same(ck.restore(1), state)


def test_no_sync_file_range_still_saves_and_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A platform without the call (not Linux, or a C library without the symbol): no early writeback, the
    same fsyncs, the same checkpoint."""
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", str(MiB))
    monkeypatch.setattr(writeback, "sync_range", None)
    state = _state(6)
    fsynced = _fsynced_inodes(monkeypatch)
    with Checkpointer(LocalStorage(tmp_path, io="buffered"), event_log=False) as ck:
        handle = ck.save(1, state)
        assert "writeback" not in handle.stats.extra["io"]
        assert _shard_inodes(tmp_path, 1) <= set(fsynced)
        assert_same(ck.restore(1), state)
        assert ck.verify(1).ok


def _answering(err: int, calls: list[int]) -> Callable[[int, int, int, int], int]:
    def answer(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append(offset)
        return err

    return answer


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP])
def test_a_refusal_turns_early_writeback_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", str(MiB))
    calls: list[int] = []
    monkeypatch.setattr(writeback, "sync_range", _answering(err, calls))
    state = _state(6)
    with Checkpointer(LocalStorage(tmp_path, io="buffered"), event_log=False) as ck:
        handle = ck.save(1, state)
        assert "writeback" not in handle.stats.extra["io"]
        assert 1 <= len(calls) <= 2  # once per writer lane, then off for that file
        assert_same(ck.restore(1), state)


def test_an_error_starting_the_writeback_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EIO or ENOSPC from the kernel: the bytes may never reach the disk, so the save fails, naming the shard,
    leaves nothing visible, and the next save (the error gone) succeeds."""
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", str(MiB))
    calls: list[int] = []
    real = writeback.sync_range
    monkeypatch.setattr(writeback, "sync_range", _answering(errno.ENOSPC, calls))
    state = _state(6)
    with Checkpointer(LocalStorage(tmp_path, io="buffered"), event_log=False) as ck:
        with pytest.raises(StorageError, match=r"shard-.*writeback") as info:
            ck.save(1, state)
        assert "No space left" in str(info.value)
        assert calls and ck.list() == []
        monkeypatch.setattr(writeback, "sync_range", real)
        ck.save(2, state)
        assert [info.step for info in ck.list()] == [2]
        assert_same(ck.restore(2), state)


def test_memory_tier_and_the_knob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tmpfs keeps no dirty pages to write back: no call there. ``TIERSAVE_WRITEBACK_BYTES=0`` turns early
    writeback off; a negative or non-integer value is refused with the variable's name."""
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", str(MiB))
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tiersave-writeback-"))
    try:
        memory = LocalStorage(shm, io="buffered")
        writer = memory.open_writer("f")
        writer.write_at(0, memoryview(os.urandom(4 * MiB)))
        writer.finish(4 * MiB)
        assert memory.io_stats.writeback.calls == 0
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", "0")
    disk = LocalStorage(tmp_path, io="buffered")
    writer = disk.open_writer("g")
    writer.write_at(0, memoryview(os.urandom(4 * MiB)))
    writer.finish(4 * MiB)
    assert disk.io_stats.writeback.calls == 0
    for bad in ("-1", "16MiB"):
        monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", bad)
        with pytest.raises(ConfigError, match="TIERSAVE_WRITEBACK_BYTES"):
            disk.open_writer("h")
        assert not (tmp_path / "h").exists()  # the file created for it is removed again


def test_a_buffered_writer_with_a_size_hint_allocates_its_blocks_up_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks allocated range by range at writeback, by two threads, interleave on disk (a file in dozens of
    pieces, slower to delete): a writer that starts writeback early allocates the hinted size at open, and
    ``finish`` trims the file to what was written."""
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", str(MiB))
    storage = LocalStorage(tmp_path, io="buffered")
    writer = storage.open_writer("f", size_hint=8 * MiB + 5)
    st = os.fstat(writer._fd)  # type: ignore[arg-type]
    assert st.st_blocks * 512 >= 8 * MiB + 5
    data = os.urandom(6 * MiB + 3)
    writer.write_at(0, memoryview(data))
    writer.finish(len(data))
    assert (tmp_path / "f").read_bytes() == data
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", "0")  # no early writeback: blocks allocated at the fsync
    writer = storage.open_writer("g", size_hint=8 * MiB)
    assert os.fstat(writer._fd).st_blocks == 0  # type: ignore[arg-type]
    writer.abort()
