"""What rank 0 (or a node leader) says when a rank's shard is not where its commit would make it visible: another
rank's missing shard points at a root the ranks do not share, but the checking rank's own shard, which it wrote
there itself, can only have been removed or changed by another process. The multi-process case is in
tests/dist/test_collective_checkpointer.py."""

from __future__ import annotations

import pytest

import tiersave
from tiersave.collective import merge_parts, rank_part
from tiersave.commit import check_shards_visible
from tiersave.format.manifest import ShardInfo, TensorEntry
from tiersave.storage.posix import LocalStorage

PREFIX = "step-0000000007.tmp-1-0000abcd-00112233445566ff"


def manifest(world: int):
    parts = []
    for rank in range(world):
        tensors = {"w": TensorEntry("w", "float32", (2048,), 0, 0, 8192, ("00000000",))}
        shard = ShardInfo(f"shard-{rank:05d}-000.bin", rank, 8192)
        parts.append(rank_part(rank, [shard], tensors, {"w": {"$tensor": "w"}}))
    return merge_parts(7, parts, chunk_bytes=1 << 20, metrics={}, tags=(), metadata={}, stats={})


def test_another_ranks_missing_shard_points_at_the_root_or_a_removal(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.put(f"{PREFIX}/shard-00000-000.bin", bytes(8192))
    with pytest.raises(tiersave.CorruptCheckpointError) as err:
        check_shards_visible(storage, PREFIX, manifest(2))
    message = str(err.value)
    assert "rank 1's shard shard-00001-000.bin is not visible to rank 0" in message
    assert "every rank must save to one root" in message and "if the root is shared, another process" in message
    assert "wrote it there itself" not in message and "nothing is left" not in message


def test_the_checking_ranks_own_shard_changed_or_gone_is_a_removal_never_the_root(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.put(f"{PREFIX}/shard-00000-000.bin", bytes(4096))
    storage.put(f"{PREFIX}/shard-00001-000.bin", bytes(8192))
    with pytest.raises(tiersave.CorruptCheckpointError) as err:
        check_shards_visible(storage, PREFIX, manifest(2))
    message = str(err.value)
    assert "rank 0's shard shard-00000-000.bin is 4096 bytes, not 8192" in message
    assert "although rank 0 wrote it there itself" in message and "one root" not in message
    storage.delete_prefix(PREFIX)  # a node leader (rank 1) checking its node's shards finds the attempt gone
    with pytest.raises(tiersave.CorruptCheckpointError) as err:
        check_shards_visible(storage, PREFIX, manifest(2), {1}, rank=1)
    message = str(err.value)
    assert "rank 1's shard shard-00001-000.bin is not visible to rank 1" in message
    assert f"nothing is left of the attempt {PREFIX}" in message and "although rank 1 wrote it" in message


def test_every_shard_in_place_passes(tmp_path):
    storage = LocalStorage(tmp_path)
    for rank in range(2):
        storage.put(f"{PREFIX}/shard-{rank:05d}-000.bin", bytes(8192))
    check_shards_visible(storage, PREFIX, manifest(2))
