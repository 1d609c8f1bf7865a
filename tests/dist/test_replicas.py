"""Peer-memory replicas on simulated nodes (real gloo processes on 127.0.0.1, one memory directory per node):
replication after each committed save, restore of a lost node's ranks from a peer's replica, and the fallbacks
when the replica is gone, corrupted or was torn by a crash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tiersave.catalog import Catalog
from tiersave.cli import main as cli_main
from tiersave.storage.posix import LocalStorage

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "replica_workers.py"
DEADLINE_S = 120


class Nodes:
    """``n`` simulated nodes of ``per_node`` ranks: per-rank environment (node rank, local rank, memory dir)."""

    def __init__(self, tmp: Path, n: int, per_node: int = 1) -> None:
        self.root = tmp / "durable"
        self.shm = [tmp / f"shm-node{i}" for i in range(n)]
        self.n, self.per_node = n, per_node

    def rank_env(self) -> dict[int, dict[str, str]]:
        out = {}
        for rank in range(self.n * self.per_node):
            node = rank // self.per_node
            out[rank] = {
                "GROUP_RANK": str(node),
                "LOCAL_RANK": str(rank % self.per_node),
                "TIERSAVE_SHM_DIR": str(self.shm[node]),
            }
        return out

    def env(self, **extra: str) -> dict[str, str]:
        return {"TIERSAVE_TEST_ROOT": str(self.root), **extra}

    def replica(self, holder: int, node: int) -> Path:
        return self.shm[holder] / "replicas" / "run" / f"node-{node}"

    def memory(self, node: int) -> Path:
        return self.shm[node] / "run"

    def lose(self, node: int) -> None:
        """The node is replaced: its memory is empty."""
        shutil.rmtree(self.shm[node])


def run(launch: Any, nodes: Nodes, scenario: str, **env: str) -> Any:
    job = launch(
        scenario,
        nodes.n * nodes.per_node,
        script=SCRIPT,
        env=nodes.env(**env),
        rank_env=nodes.rank_env(),
        deadline_s=DEADLINE_S,
    )
    for r in range(nodes.n * nodes.per_node):
        assert "crash" not in job.rank(r), job.rank(r)["crash"]
    return job


def steps(path: Path) -> list[int]:
    return Catalog(LocalStorage(path, create=False)).steps() if path.exists() else []


@pytest.mark.parametrize("lost", [1, 0])  # node 0 holds rank 0, which decides which copies the ranks try
def test_lost_node_restores_bit_exact_from_the_peer_replica(launch, tmp_path, lost, monkeypatch, capsys):
    nodes = Nodes(tmp_path, 2)
    saved = run(launch, nodes, "save")
    for r in range(2):  # each node's leader saw its part replicated, for every step
        assert saved.rank(r)["replicas"] == {"1": "ok", "2": "ok", "3": "ok"}
    assert steps(nodes.replica(0, 1)) == [2, 3]  # node 0 holds node 1's part; retention keep=2 applies
    assert steps(nodes.replica(1, 0)) == [2, 3]
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(nodes.shm[0]))  # `tiersave ls` on node 0
    capsys.readouterr()
    assert cli_main(["ls", "mem://run", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [c["step"] for c in listing["checkpoints"]] == [2, 3] and listing["replicas"] == {"1": [2, 3]}
    nodes.lose(lost)
    job = run(launch, nodes, "restore")
    for r in range(2):
        assert job.rank(r)["step"] == 3 and job.rank(r)["consistent"] and job.rank(r)["tier"] == "memory", job.rank(r)
    assert f"pulled from node {1 - lost}" in job.rank(lost)["source"]
    assert "pulled" not in job.rank(1 - lost)["source"]
    assert steps(nodes.memory(lost)) == [3]  # the pulled part is in the replacement's memory now


@pytest.mark.parametrize("tag", ["best", "serving"])  # a manifest tag; a movable tag (lost with node 0's memory)
def test_tag_restore_after_the_loss_of_rank_0s_node_reads_the_replica(launch, tmp_path, tag):
    nodes = Nodes(tmp_path, 2)
    run(launch, nodes, "save")
    nodes.lose(0)  # rank 0's memory (and its movable tag files) is gone: the other node still knows the tag
    job = run(launch, nodes, "restore", TIERSAVE_TEST_TAG=tag)
    for r in range(2):
        rec = job.rank(r)
        assert rec["step"] == 2 and rec["consistent"] and rec["tier"] == "memory", rec
    assert "pulled from node 1" in job.rank(0)["source"] and "pulled" not in job.rank(1)["source"]


def test_replica_also_lost_falls_back_to_the_durable_copy_with_the_reason(launch, tmp_path):
    nodes = Nodes(tmp_path, 2)
    run(launch, nodes, "save")
    nodes.lose(1)
    shutil.rmtree(nodes.replica(0, 1))  # the holder lost it too (two losses with replicas=1)
    job = run(launch, nodes, "restore")
    for r in range(2):
        rec = job.rank(r)
        assert rec["tier"] == "durable" and rec["step"] == 2 and rec["consistent"], rec
        assert "no usable checkpoint" in rec["memory_error"]
    assert "no peer holds a valid replica" in job.rank(1)["memory_error"]
    assert any("could not use this copy" in w or "no peer holds" in w for w in job.rank(0)["warnings"])


def test_corrupted_replica_chunk_is_detected_and_an_older_step_is_used(launch, tmp_path):
    nodes = Nodes(tmp_path, 2)
    run(launch, nodes, "save")
    nodes.lose(1)
    shard = next(nodes.replica(0, 1).glob("step-*3/shard-*.bin"))
    with open(shard, "r+b") as f:  # one flipped byte inside the first tensor
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    job = run(launch, nodes, "restore")
    for r in range(2):
        rec = job.rank(r)
        assert rec["step"] == 2 and rec["consistent"] and rec["tier"] == "memory", rec
    assert "pulled from node 0" in job.rank(1)["source"]
    assert any("checksum mismatch" in w for w in job.rank(1)["warnings"]), job.rank(1)["warnings"]
    assert steps(nodes.memory(1)) == [2]  # the corrupted step 3 was never published


def test_kill_during_replication_leaves_no_usable_partial_replica(launch, tmp_path):
    nodes = Nodes(tmp_path, 2)
    # node 0's process dies (SIGKILL) while it holds every shard of node 1's step 3, before publishing it
    job = launch(
        "save",
        2,
        script=SCRIPT,
        env=nodes.env(),
        rank_env={**nodes.rank_env(), 0: {**nodes.rank_env()[0], "TIERSAVE_CRASHPOINT": "replica_received:3"}},
        deadline_s=DEADLINE_S,
    )
    assert job.returncodes[0] != 0
    assert steps(nodes.replica(0, 1)) == [1, 2]
    assert any(".tmp-" in p.name for p in nodes.replica(0, 1).iterdir())  # the torn copy, never published
    nodes.lose(1)
    job = run(launch, nodes, "restore")
    for r in range(2):
        rec = job.rank(r)
        assert rec["consistent"], rec
        assert rec["step"] == 2 and rec["tier"] == "memory", rec  # step 3's torn replica was not used
    assert "pulled from node 0" in job.rank(1)["source"]


def test_replicated_state_is_refused_with_a_node_local_memory_tier(launch, tmp_path):
    """A tensor written once in total would lie in one node's memory only: every rank gets the same clear
    error and nothing is committed."""
    nodes = Nodes(tmp_path, 2)
    job = run(launch, nodes, "save_replicated")
    for r in range(2):
        assert "saved" not in job.rank(r)
        assert job.rank(r)["error"].startswith("ConfigError: replicated= is not supported with a memory"), job.rank(r)
        assert steps(nodes.memory(r)) == []


def test_two_nodes_of_two_ranks_each_rank_reads_its_part_from_the_peer(launch, tmp_path):
    nodes = Nodes(tmp_path, 2, per_node=2)
    saved = run(launch, nodes, "save", TIERSAVE_TEST_STEPS="2")
    assert saved.rank(0)["replicas"] == {"1": "ok", "2": "ok"} and saved.rank(2)["replicas"] == {"1": "ok", "2": "ok"}
    assert "replicas" not in saved.rank(1) or saved.rank(1)["replicas"] == {}  # only node leaders replicate
    nodes.lose(1)
    job = run(launch, nodes, "restore")
    for r in range(4):
        assert job.rank(r)["step"] == 2 and job.rank(r)["consistent"], job.rank(r)
    assert "pulled from node 0" in job.rank(2)["source"] and "pulled from node 0" in job.rank(3)["source"]
    assert steps(nodes.memory(1)) == [2]


def test_three_nodes_replicas_cross_racks_and_survive_a_rack_loss(launch, tmp_path):
    """Nodes 0 and 1 in rack A, node 2 in rack B: every replica lands in the other rack, so losing rack A (two
    nodes at once) still restores every rank from memory, bit-exact."""
    nodes = Nodes(tmp_path, 3)
    racks = {0: "rackA", 1: "rackA", 2: "rackB"}
    rank_env = {r: {**e, "TIERSAVE_FAILURE_DOMAIN": racks[r]} for r, e in nodes.rank_env().items()}

    def go(scenario: str) -> Any:
        job = launch(scenario, 3, script=SCRIPT, env=nodes.env(), rank_env=rank_env, deadline_s=DEADLINE_S)
        for r in range(3):
            assert "crash" not in job.rank(r), job.rank(r)["crash"]
        return job

    go("save")
    assert steps(nodes.replica(2, 0)) == [2, 3] and steps(nodes.replica(2, 1)) == [2, 3]  # rack B holds rack A's
    assert steps(nodes.replica(1, 2)) == [2, 3] and not nodes.replica(0, 1).exists()  # never in the same rack
    nodes.lose(0)
    nodes.lose(1)
    job = go("restore")
    for r in range(3):
        assert job.rank(r)["step"] == 3 and job.rank(r)["consistent"] and job.rank(r)["tier"] == "memory", job.rank(r)
    assert "pulled from node 2" in job.rank(0)["source"] and "pulled from node 2" in job.rank(1)["source"]
