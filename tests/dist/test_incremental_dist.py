"""Incremental saves with many ranks (docs/format.md section 9), in real multi-process jobs (gloo on
127.0.0.1): each rank references its own unchanged shards of the previous committed checkpoint; retention keeps
what a kept global manifest references; every step restores bit for bit on every rank; a rank's corrupted
referenced shard is caught in every checkpoint that uses it; another number of ranks starts a full save."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import worker_env
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.format.layout import step_dirname
from tiersave.storage.posix import LocalStorage

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "incremental_workers.py"
TIMEOUT = 8.0
MiB = 1 << 20


def run_chain(launch, root: Path, world: int, steps: str, restore: str, keep: int = 0):
    env = worker_env(root, TIMEOUT, STEPS=steps, RESTORE=restore, KEEP=str(keep))
    job = launch("chain", world, env=env, script=SCRIPT, deadline_s=120)
    for r in range(world):
        assert "crash" not in job.rank(r), job.rank(r)
    return job


def lora(rank: int, step: int) -> dict:
    sys.path.insert(0, str(HERE))
    from incremental_workers import lora

    return lora(rank, step)


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_references_its_own_shards_and_every_kept_step_restores(launch, tmp_path, world):
    root = tmp_path / "ckpt"
    job = run_chain(launch, root, world, "1,2,3,4", "1,3,4", keep=2)
    # retention (rank 0's) kept the two newest and step 1, whose base shards they reference
    assert job.rank(0)["kept"] == [1, 3, 4]
    for r in range(world):
        rec = job.rank(r)
        assert rec["restored"] == {"1": True, "3": True, "4": True}, rec
        assert rec["referenced"]["1"] == 0
        assert all(rec["referenced"][s] >= 9 * MiB for s in ("2", "3", "4")), rec
    catalog = Catalog(LocalStorage(root))
    first, last = catalog.manifest(1), catalog.manifest(4)
    assert last.world_size == world and last.referenced_steps == {1}
    held = {(s.rank, s.file): s for s in first.shards}
    refs = [s for s in last.shards if s.step is not None]
    assert sorted(s.rank for s in refs) == list(range(world))  # one base shard per rank, each its own
    for ref in refs:
        assert ref.file.startswith(f"shard-{ref.rank:05d}-")
        assert held[(ref.rank, ref.file)].content == ref.content
    assert not (root / step_dirname(2)).exists()
    for step in (1, 3, 4):
        report = catalog.verify(step)
        assert report.ok, report.errors
    with tiersave.Checkpointer(root, event_log=False, handle_sigterm=False) as reader:
        for r in range(world):
            got, expected = reader.restore(4, rank=r), lora(r, 4)
            assert torch.equal(got["base"], expected["base"]) and torch.equal(got["adapter"], expected["adapter"])


def test_a_ranks_corrupted_referenced_shard_is_caught_in_every_checkpoint_using_it(launch, tmp_path):
    root = tmp_path / "ckpt"
    run_chain(launch, root, 2, "1,2,3", "3")
    catalog = Catalog(LocalStorage(root))
    (shard,) = (s for s in catalog.manifest(3).shards if s.step is not None and s.rank == 1)
    path = root / step_dirname(1) / shard.file
    data = bytearray(path.read_bytes())
    data[4096] ^= 0x40
    path.write_bytes(bytes(data))
    for step in (1, 2, 3):
        report = catalog.verify(step)
        assert not report.ok and any(shard.file in e for e in report.errors), (step, report.errors)
    with tiersave.Checkpointer(root, event_log=False, handle_sigterm=False) as reader:
        for step in (2, 3):
            with pytest.raises(tiersave.CorruptCheckpointError, match=shard.file):
                reader.restore(step, rank=1)
            assert torch.equal(reader.restore(step, rank=0)["adapter"], lora(0, step)["adapter"])


def test_another_number_of_ranks_saves_in_full_then_references_again(launch, tmp_path):
    root = tmp_path / "ckpt"
    run_chain(launch, root, 2, "1,2", "2")
    job = run_chain(launch, root, 3, "3,4", "3,4")
    catalog = Catalog(LocalStorage(root))
    three, four = catalog.manifest(3), catalog.manifest(4)
    assert three.world_size == 3 and not three.referenced_steps  # 2-rank shards hold other ranks' state
    assert four.referenced_steps == {3}
    for r in range(3):
        rec = job.rank(r)
        assert rec["referenced"]["3"] == 0 and rec["referenced"]["4"] >= 9 * MiB, rec
        assert rec["restored"] == {"3": True, "4": True}, rec
    assert catalog.manifest(2).referenced_steps == {1}  # the 2-rank chain is untouched and still restores


def test_a_chain_of_references_ends_on_every_rank_at_the_same_save(launch, tmp_path):
    """Without ``full_every``, tensors changed in turn chain every save to the one before. Once rank 0's
    retention keeps more than MAX_KEPT_BY_REFERENCES steps for references alone, every rank's next save is
    full: a bound on rank 0's chain alone left the other ranks referencing, and every step kept."""
    from tiersave.references import MAX_KEPT_BY_REFERENCES

    root = tmp_path / "ckpt"
    job = launch("turns", 2, env=worker_env(root, TIMEOUT), script=SCRIPT, deadline_s=180)
    recs = [job.rank(r) for r in range(2)]
    for rec in recs:
        assert "crash" not in rec and rec["restored"] is True, rec
    assert recs[0]["full"] == recs[1]["full"], recs  # the same saves, on every rank
    assert recs[0]["full"][0] == 1 and len(recs[0]["full"]) >= 2, recs  # and one after the first ended the chain
    # Bounded at every save: the two kept, the chain, and the full saves that end it (the figure lags one pass).
    assert max(recs[0]["listed"]) <= 2 + MAX_KEPT_BY_REFERENCES + 3, recs[0]["listed"]
    catalog = Catalog(LocalStorage(root))
    for step in catalog.steps():
        assert catalog.verify(step).ok, step


def test_after_a_rank_fails_to_stage_every_rank_saves_in_full_next(launch, tmp_path):
    """A save that failed on one rank's staging fails on every rank, and the next save starts the chain over on
    every rank, the failing one included (it voted no without a commit outcome, and kept referencing before)."""
    root = tmp_path / "ckpt"
    job = launch("one_rank_fails_staging", 2, env=worker_env(root, TIMEOUT), script=SCRIPT, deadline_s=120)
    recs = [job.rank(r) for r in range(2)]
    for rec in recs:
        assert "crash" not in rec, rec
        assert set(rec["failed"]) == {"3"}, rec
        assert rec["referenced"]["2"] >= 9 * MiB and rec["referenced"]["4"] == 0, rec
        assert rec["referenced"]["5"] >= 9 * MiB and rec["restored"] == {"4": True, "5": True}, rec
    assert "injected: rank 1 cannot stage step 3" in recs[1]["failed"]["3"]
    catalog = Catalog(LocalStorage(root))
    assert catalog.steps() == [1, 2, 4, 5] and not catalog.manifest(4).referenced_steps
