"""Kill the saving process (SIGKILL) at random instants and at every protocol boundary; restore must
always return a complete, verified checkpoint no older than the last acknowledged one, never a torn one.

Children are forked from the test process (torch already imported), so a trial costs milliseconds, not
an interpreter start. Each test prints its trial count and seed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

import tiersave
from helpers import assert_same, listing
from tiersave._crash import CRASHPOINTS


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {f"layer{i}": torch.randn(256, 256, generator=g) for i in range(8)},  # 2 MiB
        "small": torch.randn(3, generator=g),
        "step": step,
    }


def _child(root: Path, first_step: int, ack_fd: int, crashpoint: str | None) -> None:
    """Runs in the forked child: save steps forever, writing each acknowledged step to ``ack_fd``."""
    # libgomp is not fork-safe: a parallel region in a forked child of a process that already used OpenMP
    # threads deadlocks. One intra-op thread keeps torch out of OpenMP here (a harness concern only).
    torch.set_num_threads(1)
    try:
        if crashpoint:
            os.environ["TIERSAVE_CRASHPOINT"] = crashpoint
        with tiersave.Checkpointer(root, io_threads=2) as ckpt:
            step = first_step
            while True:
                ckpt.save(step, state_for(step))
                os.write(ack_fd, f"{step}\n".encode())
                step += 1
    finally:
        os._exit(3)


def run_and_kill(
    root: Path, first_step: int, delay_s: float | None, crashpoint: str | None = None
) -> tuple[list[int], int]:
    """Fork a saver; SIGKILL it after ``delay_s`` (or let a crash point kill it). Returns (acked, wait status)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(root, first_step, w, crashpoint)
    os.close(w)
    if delay_s is not None:
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    return [int(x) for x in data.split()], status


def check_invariant(root: Path, acked: list[int]) -> int:
    """Restore must give a verified checkpoint at or after the last acknowledged step; returns its step."""
    with tiersave.Checkpointer(root) as ckpt:
        steps = ckpt.catalog.steps()
        if not acked and not steps:
            return 0  # nothing was ever committed (steps start at 1)
        latest = steps[-1]
        assert not acked or latest >= acked[-1], f"acknowledged step {acked[-1]} lost (latest {latest})"
        restored = ckpt.restore()
        assert ckpt.last_restore.step == latest and not ckpt.last_restore.skipped
        assert_same(restored, state_for(latest))
        assert ckpt.verify(latest).ok
        return latest


def test_random_sigkill_during_saves_never_tears_a_checkpoint(root, seed):
    rng = random.Random(seed)
    trials = int(os.environ.get("TIERSAVE_CRASH_TRIALS", "40"))
    next_step, killed_mid_save, saved_any = 1, 0, False
    for _ in range(trials):
        acked, status = run_and_kill(root, next_step, rng.uniform(0.0, 0.4))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        latest = check_invariant(root, acked)
        leftovers = [p.name for p in root.iterdir() if ".tmp-" in p.name]
        killed_mid_save += bool(leftovers)
        saved_any = saved_any or bool(acked)
        with tiersave.Checkpointer(root) as ckpt:
            ckpt.prune(keep_last=2)  # removes the torn save's temporary directory too
        assert not [p for p in root.iterdir() if ".tmp-" in p.name]
        next_step = max(latest, next_step) + 1
    print(f"trials={trials} violations=0 kills_during_a_save={killed_mid_save} seed={seed}")
    assert saved_any, "no save was ever acknowledged; the children never got to save"
    assert killed_mid_save > 0, "no kill landed inside a save; the test did not exercise what it names"


_BEFORE_RENAME = {"save_begin", "after_shard_write", "after_shard_fsync", "after_manifest"}


@pytest.mark.parametrize("occurrence", [1, 3])
@pytest.mark.parametrize("point", CRASHPOINTS)
def test_crash_at_every_protocol_boundary(root, point, occurrence):
    acked, status = run_and_kill(root, 1, None, crashpoint=f"{point}:{occurrence}")
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"crash point {point} was never hit"
    crashed_in = occurrence  # saves are steps 1, 2, 3...; the k-th save crashed
    assert acked == list(range(1, crashed_in))
    latest = check_invariant(root, acked)
    expected = crashed_in - 1 if point in _BEFORE_RENAME else crashed_in
    assert latest == expected, f"crash at {point} in save {crashed_in}: latest is {latest}, expected {expected}"
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.prune(keep_last=10)
        assert not [p for p in root.iterdir() if ".tmp-" in p.name or ".trash-" in p.name]
        # the interrupted step can be saved again
        if expected < crashed_in:
            ckpt.save(crashed_in, state_for(crashed_in))
            assert_same(ckpt.restore(), state_for(crashed_in))


def test_crash_while_deleting_leaves_no_half_checkpoint(root):
    with tiersave.Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state_for(step))
    # a delete interrupted after the atomic un-commit (rename to .trash-) leaves only trash behind
    os.rename(root / "step-0000000001", root / "step-0000000001.trash-deadbeef")
    with tiersave.Checkpointer(root) as ckpt:
        assert ckpt.catalog.steps() == [2, 3]
        assert [name for name, status in ckpt.catalog.leftovers()] == ["step-0000000001.trash-deadbeef"]
        ckpt.prune(keep_last=5)
        assert listing(root) == ["step-0000000002", "step-0000000003"]


@contextlib.contextmanager
def live_save(root: Path, step: int):
    """Another process, alive, in the middle of saving ``step``: its temporary directory exists and stays
    while the block runs; the process is killed at the end. Yields the directory's name."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        from tiersave.commit import tmp_token
        from tiersave.format.layout import tmp_dirname

        name = tmp_dirname(step, tmp_token())
        (root / name).mkdir()
        os.write(w, name.encode())
        time.sleep(30)
        os._exit(0)
    os.close(w)
    try:
        yield os.read(r, 200).decode()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_prune_keeps_the_directory_of_a_live_save(root):
    with live_save(root, 9) as live, tiersave.Checkpointer(root) as ckpt:
        ((name, status),) = ckpt.catalog.leftovers()
        assert status == "live" and name == live
        ckpt.prune(keep_last=1)
        assert (root / name).exists()
    with tiersave.Checkpointer(root) as ckpt:
        assert ckpt.catalog.leftovers() == [(name, "dead")]
        ckpt.prune(keep_last=1)
        assert not (root / name).exists()


@pytest.mark.parametrize("root_kind", ["local", "mem"])
def test_the_next_save_removes_a_killed_saves_leftovers_but_never_a_live_ones(tmp_path, root_kind):
    """A save killed mid-write leaves its temporary directory; the next successful save on that tier removes
    it (its writer is dead on this host), while another writer's directory that is still live stays."""
    if root_kind == "mem":
        import uuid

        from tiersave.storage.memory import MemoryStorage

        storage = MemoryStorage(f"leftovers-{uuid.uuid4().hex[:8]}")
        root = Path(storage.root)
        target: object = storage
    else:
        root = tmp_path / "ckpt"
        target = root
    try:
        acked, status = run_and_kill(root, 1, None, crashpoint="after_shard_write:2")
        assert acked == [1] and os.WIFSIGNALED(status)
        dead = [p.name for p in root.iterdir() if ".tmp-" in p.name]
        assert len(dead) == 1
        with live_save(root, 50) as live, tiersave.Checkpointer(target) as ckpt:  # type: ignore[arg-type]
            ckpt.save(2, state_for(2))
            ckpt.wait()
            left = sorted(p.name for p in root.iterdir() if ".tmp-" in p.name)
        assert dead[0] not in left  # removed by the save's follow-up
        assert left == [live]  # the live one stays
    finally:
        if root_kind == "mem":
            import shutil

            shutil.rmtree(root, ignore_errors=True)


def test_a_checkpoint_retention_wants_gone_mid_read_is_read_whole_then_deleted(root):
    """Another process's retention (a writer saving fast with keep_last=1) wants the checkpoint a reader is
    reading gone: the reader's lease keeps it until the read ends, then the next pass deletes it. (Deleted
    before the read began: "not found", never "corrupt", tests/unit/test_leases.py.)"""
    from tiersave.storage.posix import LocalStorage
    from tiersave.testing.faults import FaultyStorage

    class SavesOnFirstShardOpen(FaultyStorage):
        hook = None

        def open_reader(self, key):
            if self.hook is not None and "shard-" in key:
                hook, self.hook = self.hook, None
                hook()
            return super().open_reader(key)

    with tiersave.Checkpointer(root, keep_last=1) as writer:
        writer.save(1, state_for(1))
        storage = SavesOnFirstShardOpen(LocalStorage(root))
        storage.hook = lambda: writer.save(2, state_for(2))  # its retention wants step 1 gone mid-read
        with tiersave.Checkpointer(storage) as reader, warnings.catch_warnings():
            warnings.simplefilter("error")  # no "skipping" warning either
            restored = reader.restore()
        assert reader.last_restore.step == 1
        assert_same(restored, state_for(1))
        assert writer.catalog.steps() == [1, 2]
        storage.hook = lambda: writer.save(3, state_for(3))
        with tiersave.Checkpointer(storage) as reader:
            assert_same(reader.restore(2), state_for(2))  # an explicit step too
        writer.save(4, state_for(4))  # the reads are over: the next pass deletes what they held
        assert writer.catalog.steps() == [4]
