"""The streamed restore from a peer's replica without a job: real ReplicaServers on loopback serving real
memory tiers, the restore reading straight from the stream into new tensors (every chunk checked once), the
fallback to the next holder when a chunk is corrupted, and nothing written to the replacement's memory."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog, OpenCheckpoint
from tiersave.errors import CheckpointNotFoundError
from tiersave.partial import Selection
from tiersave.replica import PeerClient, PeerError, ReplicaServer
from tiersave.replica_read import read_from_holders
from tiersave.restore import Restore
from tiersave.storage.memory import MemoryStorage

STEP = 5


@pytest.fixture
def holders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[list[ReplicaServer], Any, dict[str, Any]]]:
    """Two holders of the same committed step (the second a copy of the first's directory), each served by
    a ReplicaServer; TIERSAVE_SHM_DIR then points at an empty replacement node."""
    state = {f"t{i}": torch.randn(200_000 + i) for i in range(4)}
    state["small"] = torch.arange(10)
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(tmp_path / "holder0"))
    with tiersave.Checkpointer(tiers=[tiersave.Tier("mem://run")], event_log=False, chunk_bytes=256 << 10) as ckpt:
        ckpt.save(STEP, state)
    shutil.copytree(tmp_path / "holder0", tmp_path / "holder1", symlinks=True)
    servers = []
    for i in range(2):
        monkeypatch.setenv("TIERSAVE_SHM_DIR", str(tmp_path / f"holder{i}"))
        served = MemoryStorage("run")
        servers.append(ReplicaServer("127.0.0.1", "tok", 5, lambda ns, s=served: s, lambda n, s: None, node=i))
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(tmp_path / "replacement"))
    yield servers, tmp_path, state
    for server in servers:
        server.close()


def _restore(servers: list[ReplicaServer], selection: Selection | None = None) -> tuple[Any, int, MemoryStorage]:
    local = MemoryStorage("run")
    with ThreadPoolExecutor(4) as pool:

        def read(ckpt: OpenCheckpoint) -> Any:
            return Restore(ckpt, None, True, selection or Selection()).run(pool)[0]

        clients = [PeerClient(s.address, "tok", 5) for s in servers]
        result, client = read_from_holders(clients, "own", STEP, local, read)
    return result, client.peer.node, local


def _corrupt(root: Path) -> None:
    shard = next(root.glob("run/step-*/shard-*.bin"))
    with open(shard, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0x40]))


def test_streamed_restore_is_bit_exact(holders):
    servers, _, state = holders
    got, node, local = _restore(servers)
    assert node == 0
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert Catalog(local).steps() == []  # straight into the tensors (replication.Replicas rebuilds memory)


def test_a_corrupted_chunk_fails_that_holder_and_the_next_one_is_used(holders):
    servers, tmp, state = holders
    _corrupt(tmp / "holder0")
    got, node, _ = _restore(servers)
    assert node == 1
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_every_holder_corrupted_raises_naming_each(holders):
    servers, tmp, _ = holders
    _corrupt(tmp / "holder0")
    _corrupt(tmp / "holder1")
    with pytest.raises(CheckpointNotFoundError, match=r"node 0: .*checksum mismatch.*node 1: .*checksum mismatch"):
        _restore(servers)


def test_a_partial_restore_reads_only_its_part(holders):
    servers, _, state = holders
    got, _, _ = _restore(servers, Selection(keys=("t1",)))
    assert set(got) == {"t1"} and torch.equal(got["t1"], state["t1"])


def test_a_range_outside_the_file_is_refused(holders):
    servers, _, _ = holders
    key = next(k.key for k in servers[0]._namespace("own").list() if k.key.endswith(".bin"))
    size = servers[0]._namespace("own").head(key).size
    with pytest.raises(PeerError, match="not within"):
        PeerClient(servers[0].address, "tok", 5).read_range("own", key, size, size - 10, memoryview(bytearray(20)))


def test_a_truncated_shard_on_one_holder_fails_it_and_the_next_one_is_used(holders):
    servers, tmp, state = holders
    shard = next((tmp / "holder0").glob("run/step-*/shard-*.bin"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 4096)
    got, node, _ = _restore(servers)
    assert node == 1 and all(torch.equal(got[k], v) for k, v in state.items())
