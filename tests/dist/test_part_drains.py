"""A memory tier on two simulated nodes (torchrun ``--nnodes 2 --node-rank i`` on 127.0.0.1, each node its own
memory directory, peer replicas) draining to a later shared tier: each node copies its own part, rank 0 commits
the whole; the later tier's copy restores bit-exact once both nodes' memory is gone; a node killed during its
part never lets that step become visible there."""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

import tiersave
from helpers import S3_TEST_OPTIONS
from tiersave.catalog import Catalog
from tiersave.commit import commit_for
from tiersave.partdrain import RECORD_PREFIX
from tiersave.storage.posix import LocalStorage

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "partdrain_workers.py"
TIMEOUT_S = 10

sys.path.insert(0, str(HERE))
from replica_workers import same, state  # noqa: E402


def env(tmp: Path, later: str, **extra: str) -> dict[str, str]:
    return {
        "TIERSAVE_TEST_SHM": str(tmp / "shm"),
        "TIERSAVE_TEST_LATER": later,
        "TIERSAVE_DIST_TIMEOUT": str(TIMEOUT_S),
        **extra,
    }


def ok(job: Any, ranks: int = 2) -> Any:
    for r in range(ranks):
        assert "crash" not in job.rank(r), job.rank(r)["crash"]
    return job


def wipe_memory(tmp: Path) -> None:
    shutil.rmtree(tmp / "shm")


def check_restores_on_any_world(storage: Any, step: int, world: int = 2) -> None:
    """An ordinary committed checkpoint: one process reads each rank's state of it, bit-exact."""
    with tiersave.Checkpointer(storage, event_log=False, writer_lock=False) as reader:
        for r in range(world):
            assert same(reader.restore(step, rank=r), state(r, step))


def test_two_nodes_drain_their_parts_and_the_later_tier_restores_bit_exact(launch_torchrun, tmp_path):
    later = tmp_path / "durable"
    job = launch_torchrun("drain", 2, 1, script=SCRIPT, env=env(tmp_path, str(later), TIERSAVE_TEST_STEPS="6"))
    ok(job)
    # every second save is drained; rank 0 saw the commit, node 1's leader its part durable
    assert job.rank(0)["drains"] == {"2": "committed 2", "4": "committed 4", "6": "committed 6"}
    assert job.rank(1)["drains"] == {"2": "ok", "4": "ok", "6": "ok"}
    catalog = Catalog(LocalStorage(later, create=False))
    assert catalog.steps() == [4, 6]  # rank 0 ran the tier's retention (keep=2)
    for step in (4, 6):
        assert catalog.verify(step).ok
        assert {s.rank for s in catalog.manifest(step).shards} == {0, 1}  # both nodes' parts, one checkpoint
    assert Later("local", tmp_path).leftovers() == []  # no attempt left, no record inside a checkpoint
    wipe_memory(tmp_path)
    job = ok(launch_torchrun("restore", 2, 1, script=SCRIPT, env=env(tmp_path, str(later)), deadline_s=120))
    for r in range(2):
        rec = job.rank(r)
        assert rec["step"] == 6 and rec["tier"] == "durable" and rec["consistent"], rec
    check_restores_on_any_world(LocalStorage(later, create=False), 6)


class Later:
    """The later tier of a test: a local directory, or a fresh bucket on the session's SeaweedFS server."""

    def __init__(self, kind: str, tmp: Path) -> None:
        self.env: dict[str, str] = {}
        if kind == "local":
            self.uri = str(tmp / "durable")
            self.storage: Any = LocalStorage(self.uri)
            return
        from tiersave.testing.seaweed import SeaweedServer

        server = SeaweedServer.shared()
        bucket = f"ts-partdrain-{uuid.uuid4().hex[:16]}"
        self.storage = server.storage(bucket, "run", **S3_TEST_OPTIONS)  # creates the bucket
        self.uri = server.uri(bucket, "run", **S3_TEST_OPTIONS)
        self.env = server.env()

    def steps(self) -> list[int]:
        return Catalog(self.storage).steps()

    def leftovers(self) -> list[str]:
        """Anything under the tier that is not a committed checkpoint's (attempts, records)."""
        if isinstance(self.storage, LocalStorage):
            root = Path(self.storage.root)
            left = [p.name for p in root.iterdir() if ".tmp-" in p.name]
            return left + [str(p) for p in root.rglob(f"{RECORD_PREFIX}*")]
        left = [item.prefix for item in commit_for(self.storage).leftovers()]
        return left + [o.key for o in self.storage.list("") if RECORD_PREFIX in o.key]


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_node_killed_during_its_part_leaves_the_step_invisible_and_rank_0_names_it(launch, tmp_path, kind):
    later = Later(kind, tmp_path)
    # node 1's process dies (SIGKILL) after copying its part of step 4, before its record. Plain processes with
    # torchrun's variables rather than torchrun agents: a surviving agent would wait minutes at its exit barrier.
    job = launch(
        "kill",
        2,
        script=SCRIPT,
        env={**env(tmp_path, later.uri, TIERSAVE_TEST_NODE1_CRASH="part_drain_written:2"), **later.env},
        rank_env={r: {"GROUP_RANK": str(r), "LOCAL_RANK": "0"} for r in range(2)},
        deadline_s=90,
    )
    rec = job.rank(0)
    assert 1 not in job.records  # node 1 died before writing its record
    assert rec["drains"]["2"] == "committed 2"
    failure = rec["drains"]["4"]
    assert failure.startswith("DistributedCheckpointError: ") and "node 1 (ranks [1])" in failure, failure
    assert rec["error_after_s"] < TIMEOUT_S + 10  # within the timeout, no hang
    assert any("node 1" in w and "step 4" in w for w in rec["warnings"]), rec["warnings"]
    assert later.steps() == [2]  # step 4 never became visible
    assert later.leftovers() == []  # node 1's part of the failed attempt was removed with it
    wipe_memory(tmp_path)
    check_restores_on_any_world(later.storage, 2)  # the previous one stays restorable


def test_two_nodes_of_two_ranks_drain_to_an_object_store(launch_torchrun, tmp_path):
    later = Later("s3", tmp_path)
    job = launch_torchrun("drain", 2, 2, script=SCRIPT, env={**env(tmp_path, later.uri), **later.env}, deadline_s=150)
    ok(job, 4)
    assert job.rank(0)["drains"] == {"2": "committed 2", "4": "committed 4"}
    assert job.rank(2)["drains"] == {"2": "ok", "4": "ok"}  # node 1's leader
    assert job.rank(1)["drains"] == job.rank(3)["drains"] == {}  # only node leaders drain
    assert later.steps() == [2, 4] and Catalog(later.storage).verify(4).ok
    assert {s.rank for s in Catalog(later.storage).manifest(4).shards} == {0, 1, 2, 3}
    assert later.leftovers() == []
    wipe_memory(tmp_path)
    check_restores_on_any_world(later.storage, 4, world=4)


def test_a_node_that_cannot_drain_its_part_fails_the_drain_at_once_naming_it(launch_torchrun, tmp_path):
    """Node 1 cannot commit step 4 in its memory (a directory in the way), so it has no part to drain: its record
    says so, and rank 0 fails that drain at once (not at its timeout); the other steps drain as usual."""
    later = Later("local", tmp_path)
    extra = {"TIERSAVE_TEST_NODE1_BLOCK_STEP": "4"}
    job = ok(launch_torchrun("drain", 2, 1, script=SCRIPT, env=env(tmp_path, later.uri, **extra), deadline_s=120))
    rec = job.rank(0)
    assert rec["drains"]["2"] == "committed 2"
    failure = rec["drains"]["4"]
    assert failure.startswith("DistributedCheckpointError: ") and "failed on node 1" in failure, failure
    assert "node 1's memory copy of step 4 could not be committed" in failure
    assert rec["error_after_s"] < TIMEOUT_S / 2  # the record, not the timeout
    assert later.steps() == [2] and later.leftovers() == []


def test_a_busy_tier_skips_the_same_steps_on_every_node(launch_torchrun, tmp_path):
    """Saves back to back, each due on the later tier: rank 0 skips a step while the nodes still drain an
    earlier one (a warning names it), and every node drains exactly the steps rank 0 chose."""
    later = Later("local", tmp_path)
    extra = {"TIERSAVE_TEST_STEPS": "8", "TIERSAVE_TEST_EVERY": "1"}
    job = ok(launch_torchrun("burst", 2, 1, script=SCRIPT, env=env(tmp_path, later.uri, **extra), deadline_s=150))
    first, second = job.rank(0), job.rank(1)
    assert first["failed"] == second["failed"] == []
    assert first["drained"] == second["drained"] and first["drained"][0] == 1, (first, second)
    skipped = [s for s in range(1, 9) if s not in first["drained"]]
    for step in skipped:
        assert any(w.startswith(f"step {step} is not sent to tier durable") for w in first["warnings"]), step
    assert later.steps() == first["drained"][-2:] and later.leftovers() == []


def test_a_compressed_later_tier_is_refused_on_every_rank(launch, tmp_path):
    later = Later("local", tmp_path)
    rank_env = {r: {"GROUP_RANK": str(r), "LOCAL_RANK": "0"} for r in range(2)}
    job = ok(launch("refused", 2, script=SCRIPT, env=env(tmp_path, later.uri), rank_env=rank_env, deadline_s=60))
    for r in range(2):
        error = job.rank(r).get("error", "")
        assert error.startswith("ConfigError: compress= on tier durable is not supported after a memory tier"), error
    assert later.steps() == []


def test_rank_0_failing_before_it_derives_the_prefix_still_removes_the_other_nodes_part(launch_torchrun, tmp_path):
    """Rank 0's drain of step 4 fails before it derives the attempt's prefix (the tier did not answer), while
    node 1 copies its part and writes its record there: rank 0 removes that attempt by its derived name, again
    after the next commit, so nothing of step 4 is left on the tier and it never becomes visible."""
    later = Later("local", tmp_path)
    extra = {"TIERSAVE_TEST_STEPS": "6", "TIERSAVE_TEST_RANK0_PREFIX_FAIL": "4"}
    job = ok(launch_torchrun("drain", 2, 1, script=SCRIPT, env=env(tmp_path, later.uri, **extra), deadline_s=120))
    rec = job.rank(0)
    assert rec["drains"]["4"].startswith("TransientStorageError: injected"), rec["drains"]
    assert rec["drains"]["6"] == "committed 6"
    assert job.rank(1)["drains"]["4"] == "ok"  # node 1 wrote its part of the attempt rank 0 never began
    assert later.steps() == [2, 6]
    assert later.leftovers() == []


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_rank_0_killed_before_its_drain_leaves_parts_invisible_and_the_leftover_cleanup_removes_them(
    launch, tmp_path, kind
):
    """Rank 0's process dies as its drain of step 4 starts; node 1 copies its part there and reports it. What it
    wrote is no checkpoint (step 4 is not listed), and the leftover cleanup of the next process on rank 0's host
    (a retention pass, here ``Catalog.prune``) removes it: the attempt carries the dead rank 0's pid and host."""
    later = Later(kind, tmp_path)
    job = launch(
        "kill",
        2,
        script=SCRIPT,
        env={**env(tmp_path, later.uri, TIERSAVE_TEST_RANK0_CRASH="part_drain_start:2"), **later.env},
        rank_env={r: {"GROUP_RANK": str(r), "LOCAL_RANK": "0"} for r in range(2)},
        deadline_s=90,
    )
    assert 0 not in job.records  # rank 0 died
    assert job.rank(1)["drains"] == {"2": "ok", "4": "ok"}
    assert later.steps() == [2]  # invisible
    left = later.leftovers()
    assert left and any(RECORD_PREFIX in key for key in left), left  # node 1's part and record, orphaned
    catalog = Catalog(later.storage)
    assert [status for _, status in catalog.leftovers()] == ["dead"]
    assert catalog.prune().leftovers_removed
    assert later.leftovers() == [] and later.steps() == [2]
    check_restores_on_any_world(later.storage, 2)


@pytest.mark.parametrize(("kind", "how"), [("local", "truncate"), ("s3", "delete")])
def test_a_part_whose_bytes_are_gone_after_its_record_fails_the_commit_naming_node_and_file(
    launch_torchrun, tmp_path, kind, how
):
    """Node 1's record of step 4 gives the right sizes, but one of its shards was cut short or deleted before
    rank 0's commit: rank 0 checks every shard on the tier before committing, fails the drain naming node 1 and
    the file, and commits nothing."""
    later = Later(kind, tmp_path)
    extra = {"TIERSAVE_TEST_NODE1_LOSE": f"4:{how}", **later.env}
    job = ok(launch_torchrun("drain", 2, 1, script=SCRIPT, env=env(tmp_path, later.uri, **extra), deadline_s=150))
    rec = job.rank(0)
    assert rec["drains"]["2"] == "committed 2"
    failure = rec["drains"]["4"]
    assert failure.startswith("DistributedCheckpointError: ") and "node 1's part incomplete" in failure, failure
    assert "shard-00001" in failure and "rank 1: CorruptCheckpointError" in failure, failure
    assert later.steps() == [2] and later.leftovers() == []


def test_close_ends_rank_0s_wait_for_the_parts(launch, tmp_path):
    """Node 1 dies during its part; rank 0's drain waits for its record for the whole coordination timeout,
    an hour here, so only ``close()`` can end that wait within the test: the drain still waits when
    ``close(timeout=1)`` is called, then its future fails with the documented ClosedError (the worker gives
    it 60 s) and the attempt is removed."""
    later = Later("local", tmp_path)
    job = launch(
        "abandon",
        2,
        script=SCRIPT,
        env={
            **env(tmp_path, later.uri, TIERSAVE_TEST_NODE1_CRASH="part_drain_written:1"),
            "TIERSAVE_DIST_TIMEOUT": "3600",
        },
        rank_env={r: {"GROUP_RANK": str(r), "LOCAL_RANK": "0"} for r in range(2)},
        deadline_s=150,
    )
    rec = job.rank(0)
    assert rec["waiting"], rec
    assert rec["error"].startswith("ClosedError: "), rec  # not "still waiting": close ended the wait
    assert "was closed while rank 0 waited for node(s) [1]" in rec["error"], rec
    assert later.steps() == [] and later.leftovers() == []
