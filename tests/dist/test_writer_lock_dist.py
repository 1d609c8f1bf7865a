"""With many ranks only rank 0 (the rank that commits) holds the root's writer lock: real gloo processes."""

from __future__ import annotations

import os
from pathlib import Path

from tiersave.storage.posix import LocalStorage

HERE = Path(__file__).resolve().parent


def test_only_rank_0_holds_the_writer_lock(launch, tmp_path):
    root = tmp_path / "ckpt"
    job = launch("rank0_holds", 2, env={"TIERSAVE_TEST_ROOT": str(root)}, script=HERE / "lock_workers.py")
    assert job.returncodes == [0, 0], job.logs
    r0, r1 = job.rank(0), job.rank(1)
    assert "crash" not in r0 and "crash" not in r1, job.logs
    rank0_pid = r0["pids"][0]
    assert r0["holder_pid"] == r1["holder_pid"] == rank0_pid  # rank 1 saved without taking it
    assert f"pid {rank0_pid}" in r1["second"]
    assert r0["after_close"] == r1["after_close"] == ""  # released by close


def test_a_collective_save_into_a_locked_root_fails_on_every_rank_at_once(launch, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    lock = LocalStorage(root).writer_lock()  # this test process is the live writer
    try:
        job = launch("refused", 2, env={"TIERSAVE_TEST_ROOT": str(root)}, script=HERE / "lock_workers.py")
    finally:
        lock.release()
    assert job.returncodes == [0, 0], job.logs
    r0, r1 = job.rank(0), job.rank(1)
    assert r0["error"].startswith("WriterLockedError") and f"pid {os.getpid()}" in r0["error"], r0
    assert "rank 0" in r1["error"] and "WriterLockedError" in r1["error"], r1  # told by the vote...
    assert r1["elapsed"] < 30  # ...not at its 60 s coordination timeout
    assert r0["steps"] == r1["steps"] == []
