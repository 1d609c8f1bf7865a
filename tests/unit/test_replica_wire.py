"""Peer replicas without a job: the ring placement, and the wire (a real ReplicaServer on loopback serving a
real memory tier) with the verified copy: a good copy is bit-exact, a wrong token, a corrupted chunk or a dead
peer never publishes anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.errors import ConfigError, CorruptCheckpointError
from tiersave.replica import PeerAddress, PeerClient, PeerError, ReplicaServer, fetch_part
from tiersave.replication import holders, ring
from tiersave.storage.memory import MemoryStorage


def test_ring_alternates_failure_domains_and_spreads_the_load():
    domains = {0: "rackA", 1: "rackA", 2: "rackB", 3: "rackB"}
    assert ring(domains) == [0, 2, 1, 3]
    placed = {n: holders(n, domains, 1) for n in domains}
    assert all(domains[h] != domains[n] for n, [h] in placed.items())  # never in the node's own rack
    assert sorted(h for [h] in placed.values()) == [0, 1, 2, 3]  # each node holds exactly one replica
    assert holders(0, {0: "a", 1: "b", 2: "c"}, 2) == [1, 2]
    assert holders(0, {0: "a", 1: "a", 2: "b"}, 2) == [2, 1]  # other domains first, then the rest


def test_tier_replicas_are_validated():
    with pytest.raises(ConfigError, match="replicas"):
        tiersave.Tier("mem://x", replicas=-1)
    with pytest.raises(ConfigError, match="failure_domain"):
        tiersave.Tier("mem://x", replicas=1, failure_domain=" ")
    with pytest.raises(ConfigError, match="first tier"):
        tiersave.Checkpointer(tiers=[tiersave.Tier("mem://x"), tiersave.Tier("mem://y", replicas=1)])


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A memory tier holding step 5 (one rank's state), served by a ReplicaServer; a second memory dir."""
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(tmp_path / "peer"))
    state = {"w": torch.randn(300_000), "i": torch.arange(1000)}
    with tiersave.Checkpointer(tiers=[tiersave.Tier("mem://run")], event_log=False) as ckpt:
        ckpt.save(5, state)
    source = MemoryStorage("run")
    server = ReplicaServer("127.0.0.1", "tok", 5, lambda ns: source, lambda n, s: None, node=0)
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(tmp_path / "replacement"))
    yield server, source, MemoryStorage("run"), state
    server.close()


def test_fetch_part_is_bit_exact(served):
    server, _, dst, state = served
    copied = fetch_part(PeerClient(server.address, "tok", 5), "own", dst, 5, {0})
    assert copied > 0 and Catalog(dst).steps() == [5]
    assert Catalog(dst).verify(5).ok
    with tiersave.Checkpointer(tiers=[tiersave.Tier("mem://run")], event_log=False) as ckpt:
        got = ckpt.restore(5)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["i"], state["i"])
    assert fetch_part(PeerClient(server.address, "tok", 5), "own", dst, 5, {0}) == 0  # already there


def test_wrong_token_gets_nothing(served):
    server, _, dst, _ = served
    with pytest.raises(PeerError, match="wrong job token"):
        fetch_part(PeerClient(server.address, "not-the-job", 5), "own", dst, 5, {0})
    assert Catalog(dst).steps() == []


def test_corrupted_chunk_is_refused_and_nothing_is_published(served):
    server, source, dst, _ = served
    shard = next(Path(source.root).glob("step-*/shard-*.bin"))
    with open(shard, "r+b") as f:
        f.seek(4096 * 3)
        byte = f.read(1)
        f.seek(4096 * 3)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
        fetch_part(PeerClient(server.address, "tok", 5), "own", dst, 5, {0})
    assert Catalog(dst).steps() == [] and not any(Path(dst.root).iterdir())  # the partial copy was removed


def test_a_dead_peer_fails_within_the_timeout(served):
    _, _, dst, _ = served
    with pytest.raises(PeerError, match="steps from node 7"):
        PeerClient(PeerAddress(7, "127.0.0.1", 9), "tok", 2).steps("own")
    assert Catalog(dst).steps() == []
