"""A collective Checkpointer in real multi-process jobs (gloo on 127.0.0.1): every rank saves its own state into
one checkpoint per step, committed by rank 0 only when every rank's shards are durable; a failing, dying or
missing rank makes every other rank fail with DistributedCheckpointError naming it, within the timeout, and
the previous checkpoint stays the newest and restorable."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
from helpers import worker_env
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.cli import main as cli_main
from tiersave.format.layout import MANIFEST_NAME, step_dirname
from tiersave.storage.posix import LocalStorage

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "ckpt_workers.py"
TIMEOUT = 8.0


def env(root: Path, **extra: str) -> dict[str, str]:
    return worker_env(root, TIMEOUT, **extra)


def manifest(root: Path, step: int) -> dict:
    return json.loads((root / step_dirname(step) / MANIFEST_NAME).read_bytes())


def committed_and_whole(root: Path, world: int) -> list[int]:
    """Every committed step, each checked: saved by ``world`` ranks, a shard of every rank, every byte verified."""
    catalog = Catalog(LocalStorage(root))
    steps = catalog.steps()
    for step in steps:
        doc = manifest(root, step)
        assert doc["world_size"] == world, step
        assert {s["rank"] for s in doc["shards"]} == set(range(world)), step
        assert sorted(doc["tree"]) == [f"rank-{r:05d}" for r in range(world)], step
        report = catalog.verify(step)
        assert report.ok, report.errors
    return steps


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_saves_and_restores_its_own_state(launch, tmp_path, world):
    root = tmp_path / "ckpt"
    job = launch("save_restore", world, env=env(root), script=SCRIPT)
    for r in range(world):
        rec = job.rank(r)
        assert "crash" not in rec, rec
        assert rec["async_step"] == 2 and rec["latest"] == 2
        assert rec["restored_latest"] and rec["restored_1"]
    assert committed_and_whole(root, world) == [1, 2]
    doc = manifest(root, 2)
    # each rank read only its own tensors
    assert job.rank(0)["tensors_bytes_read"] == 2048 * 4 + 3 * 8
    assert job.rank(1)["tensors_bytes_read"] == 2048 * 4 + 4 * 8
    assert set(doc["tensors"]) == {f"rank-{r:05d}/{n}" for r in range(world) for n in ("w", "b")}
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]


def test_a_single_process_reads_one_rank_or_is_told_why_it_cannot(launch, tmp_path):
    root = tmp_path / "ckpt"
    launch("save_restore", 2, env=env(root), script=SCRIPT)
    with tiersave.Checkpointer(root) as ckpt:
        with pytest.raises(tiersave.StateMismatchError, match=r"saved by 2 rank\(s\) and this job has 1.*tiersave.dcp"):
            ckpt.restore()
        one = ckpt.restore(rank=1)
        assert torch.equal(one["w"], torch.full((2048,), 1002.0)) and one["data"] == {"rank": 1, "position": 21}
        with pytest.raises(tiersave.StateMismatchError, match="no rank 5"):
            ckpt.restore(rank=5)
    assert cli_main(["verify", str(root), "--all"]) == 0


def test_restoring_onto_another_number_of_ranks_fails_clearly_on_every_rank(launch, tmp_path):
    root = tmp_path / "ckpt"
    launch("save_restore", 2, env=env(root), script=SCRIPT)
    job = launch("world_restore", 3, env=env(root), script=SCRIPT)
    for r in range(3):
        rec = job.rank(r)["restore"]
        assert rec["type"] == "StateMismatchError" and "saved by 2 rank(s) and this job has 3" in rec["message"]


def test_an_attempt_removed_before_the_commit_is_reported_as_removed_not_as_an_unshared_root(launch, tmp_path):
    # Another process deletes step 2's attempt directory after every rank wrote its shards into the one shared
    # root: rank 0 finds its own shard gone. The root is shared (rank 0 wrote there itself), so the error must
    # say the files were removed, not send the user looking for a node-local directory.
    root = tmp_path / "ckpt"
    job = launch("attempt_removed", 2, env=env(root), script=SCRIPT)
    for r in range(2):
        rec = job.rank(r)
        assert "crash" not in rec, rec
        failure = rec["save2"]
        assert failure["type"] == "DistributedCheckpointError", failure
        message = failure["message"]
        assert "rank 0's shard shard-00000-000.bin is not visible to rank 0" in message, message
        assert "although rank 0 wrote it there itself" in message and "another process removed" in message, message
        assert "nothing is left of the attempt" in message, message
        assert "every rank must save to one root" not in message, message
        assert rec["latest"] == 1
    assert committed_and_whole(root, 2) == [1]


def test_a_rank_whose_storage_fails_fails_every_rank_naming_it(launch, tmp_path):
    root = tmp_path / "ckpt"
    job = launch("rank_fails", 3, env=env(root), script=SCRIPT)
    for r in range(3):
        rec = job.rank(r)
        assert "crash" not in rec, rec
        failure = rec["save2"]
        if r == 1 and failure["type"] == "NoSpaceError":  # its own error, raised where it happened
            assert "injected" in failure["message"]
        else:
            assert failure["type"] == "DistributedCheckpointError"
            assert failure["failures"] == {"1": "NoSpaceError"} and "step 2" in failure["message"]
            assert failure["elapsed"] < TIMEOUT  # a no vote, not a timeout
        assert rec["latest_after_failure"] == 1  # nothing of step 2 became visible
        assert rec["leftovers"] == []  # and its temporary directory is gone
        assert rec["latest_after_retry"] == 2
    assert committed_and_whole(root, 3) == [1, 2]


@pytest.mark.parametrize("point", ["save_begin", "after_shard_write", "after_shard_fsync"])
def test_a_rank_killed_inside_a_save_is_named_and_nothing_is_committed(launch, tmp_path, point):
    root = tmp_path / "ckpt"
    job = launch(
        "rank_dies",
        2,
        env=env(root),
        script=SCRIPT,
        rank_env={1: {"TIERSAVE_CRASHPOINT": f"{point}:2"}},
        deadline_s=60,
    )
    rec = job.rank(0)
    assert 1 not in job.records  # rank 1 died
    failure = rec["save2"]
    assert failure["type"] == "DistributedCheckpointError" and "1" in failure["failures"]
    assert failure["elapsed"] < TIMEOUT + 5
    assert rec["latest"] == 1
    assert committed_and_whole(root, 2) == [1]
    # the restarted job restores the previous checkpoint on every rank
    job = launch("restore_check", 2, env=env(root), script=SCRIPT)
    assert [job.rank(r)["step"] for r in range(2)] == [1, 1]
    assert all(job.rank(r)["consistent"] for r in range(2))


def test_two_nodes_with_torchrun(launch_torchrun, tmp_path):
    root = tmp_path / "ckpt"
    job = launch_torchrun("save_restore", 2, 1, script=SCRIPT, env=env(root))
    assert {job.rank(r)["identity"]["node"] for r in range(2)} == {0, 1}
    assert all(job.rank(r)["restored_latest"] for r in range(2))
    assert committed_and_whole(root, 2) == [1, 2]


def test_random_kills_never_commit_a_checkpoint_with_a_missing_rank(launch, tmp_path):
    """Kill one rank of a saving job at a random instant, trial after trial: every committed checkpoint holds
    every rank's shards and verifies, and a restarted job restores the newest one consistently on every rank."""
    trials = int(os.environ.get("TIERSAVE_DIST_KILL_TRIALS", "4"))
    seed = int(os.environ.get("TIERSAVE_DIST_KILL_SEED", str(random.randrange(1 << 30))))
    print(f"random kills: {trials} trials, seed {seed} (TIERSAVE_DIST_KILL_SEED={seed} replays)")
    rng = random.Random(seed)
    root = tmp_path / "ckpt"
    violations = 0
    saves = 0
    for trial in range(trials):
        job = launch("save_loop", 2, env=env(root), script=SCRIPT, background=True)
        time.sleep(rng.uniform(3.0, 6.0))  # start-up takes a few seconds; then a save every few tens of ms
        job.kill(rng.randrange(2))
        job.finish(TIMEOUT + 15)  # the survivor fails within its timeout and exits
        try:
            steps = committed_and_whole(root, 2)
        except AssertionError:
            violations += 1
            continue
        acked = set()
        for r in range(2):
            path = job.out / f"acked{r}.txt"
            acked |= {int(x) for x in path.read_text().split()} if path.exists() else set()
        saves += len(acked)
        if not steps:
            assert not acked, (trial, acked)  # nothing acknowledged that is not committed
            continue
        assert max(acked, default=0) <= max(steps), (trial, acked, steps)
        check = launch("restore_check", 2, env=env(root), script=SCRIPT)
        if not all(check.rank(r)["consistent"] and check.rank(r)["step"] == max(steps) for r in range(2)):
            violations += 1
    print(f"random kills: {trials} trials, {saves} acknowledged saves, {violations} violations")
    assert violations == 0
