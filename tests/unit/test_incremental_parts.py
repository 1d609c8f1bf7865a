"""Incremental saves with many ranks, the pure parts (docs/format.md section 9): what a rank votes with, how
rank 0 merges references and refuses malformed or mixed ones, and the part of a global base one rank may
reference. The real multi-process jobs are in tests/dist/test_incremental_dist.py."""

from __future__ import annotations

import pytest

import tiersave
from tiersave.collective import merge_parts, rank_part
from tiersave.format.manifest import ShardInfo, TensorEntry
from tiersave.references import rank_base

H = "ef" * 32


def part(rank: int, *, ref: int | None = None, content_hash: str = "sha256") -> dict:
    shard = ShardInfo(f"shard-{rank:05d}-000.bin", rank, 8192, ((4096, H), (4096, H)), ref)
    tensors = {"w": TensorEntry("w", "float32", (2048,), 0, 0, 8192, ("00000000",))}
    return rank_part(rank, [shard], tensors, {"w": {"$tensor": "w"}}, None, content_hash)


def merge(parts: list[dict]):
    return merge_parts(7, parts, chunk_bytes=1 << 20, metrics={}, tags=(), metadata={}, stats={})


def test_references_and_hashes_survive_the_merge():
    m = merge([part(0, ref=3, content_hash="blake3"), part(1, content_hash="blake3")])
    assert m.content_hash == "blake3" and m.referenced_steps == {3}
    assert [s.step for s in m.shards] == [3, None] and all(s.content == ((4096, H), (4096, H)) for s in m.shards)


def test_ranks_hashing_with_different_functions_fail_the_save_naming_both():
    with pytest.raises(tiersave.ConfigError, match=r"different functions \(blake3, sha256\)"):
        merge([part(0, content_hash="blake3"), part(1)])


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.update(content="nope"),
        lambda s: s.update(content=[[4096]]),
        lambda s: s.update(content=[["4096", H]]),
        lambda s: s.update(step="3"),
        lambda s: s.update(step=True),
    ],
)
def test_a_malformed_shard_entry_of_a_rank_is_refused_naming_the_rank(edit):
    bad = part(1)
    edit(bad["shards"][0])
    with pytest.raises(tiersave.ConfigError, match=r"step 7: rank 1 sent a malformed shard entry"):
        merge([part(0), bad])


def test_a_rank_sees_its_own_shards_of_the_base_under_its_own_names():
    base = merge([part(0), part(1)])
    view = rank_base(base, 1, 2)
    assert view is not None and [s.rank for s in view.shards] == [1]
    assert set(view.tensors) == {"w"} and view.tensors["w"].shard == 0 and view.step == 7
    assert view.shards[0].file == "shard-00001-000.bin"


def test_a_base_of_another_world_size_is_no_base():
    base = merge([part(0), part(1)])
    assert rank_base(base, 0, 3) is None and rank_base(base, 0, 1) is None and rank_base(None, 0, 2) is None
