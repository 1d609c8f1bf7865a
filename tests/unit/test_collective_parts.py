"""The parts ranks vote with and rank 0's merge of them into the global manifest (no processes): the columns
round-trip to the entries a single process would commit, and a malformed part fails naming its rank."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tiersave.collective import encode_global, merge_parts, rank_part
from tiersave.errors import ConfigError, FormatError
from tiersave.format.manifest import Manifest, ShardInfo, TensorEntry

CHUNK = 1 << 20


def part(rank: int) -> dict[str, Any]:
    """A rank's part: two small tensors, one empty, one over two checksum chunks, in one shard."""
    tensors = {
        "a": TensorEntry("a", "float32", (4, 2), 0, 0, 32, ("0000000a",)),
        "e": TensorEntry("e", "int64", (0,), 0, 4096, 0, ()),
        "big": TensorEntry("big", "uint8", (CHUNK + 1,), 0, 4096, CHUNK + 1, ("0000000b", "0000000c")),
    }
    shards = [ShardInfo(f"shard-{rank:05d}-000.bin", rank, 4096 + CHUNK + 4096)]
    tree = {"a": {"$tensor": "a"}, "x": [{"$tensor": "e"}, {"$tensor": "big"}], "n": rank}
    return rank_part(rank, shards, tensors, tree)


def merge(parts: list[Any]) -> Manifest:
    return merge_parts(1, parts, chunk_bytes=CHUNK, metrics={}, tags=(), metadata={}, stats={})


def test_merged_parts_are_the_global_manifest_a_reader_accepts():
    m = merge([part(0), part(1)])
    assert m.world_size == 2 and [s.rank for s in m.shards] == [0, 1]
    assert m.tensors["rank-00001/big"] == TensorEntry(
        "rank-00001/big", "uint8", (CHUNK + 1,), 1, 4096, CHUNK + 1, ("0000000b", "0000000c")
    )
    assert m.tree["rank-00001"] == {
        "a": {"$tensor": "rank-00001/a"},
        "x": [{"$tensor": "rank-00001/e"}, {"$tensor": "rank-00001/big"}],
        "n": 1,
    }
    parsed = Manifest.parse(encode_global(m), path="test", expect_step=1)
    assert parsed.tensors == m.tensors and parsed.tree == m.tree


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda p: p["table"].update(dtypes=["float128", "int64", "uint8"]), "unknown dtype"),
        (lambda p: p["table"]["nbytes"].__setitem__(0, 31), "nbytes differs from its shape"),
        (lambda p: p["table"]["shard"].__setitem__(0, 1), "shard index is not below 1"),
        (lambda p: p["table"]["offset"].__setitem__(0, -4096), "non-negative int"),
        (lambda p: p["table"]["offset"].__setitem__(2, 0), "overlapping"),
        (lambda p: p["table"]["offset"].__setitem__(0, 1 << 40), "outside their shards"),
        (lambda p: p["table"].update(crc32c=p["table"]["crc32c"][:-8]), "8 hex digits for each of the 3 chunks"),
        (lambda p: p["table"].update(crc32c=p["table"]["crc32c"].upper()), "8 hex digits"),
        (lambda p: p["table"]["names"].pop(), "every column must list 2 values"),
        (lambda p: p["table"].update(names=[1, 2, 3]), "names must be a list of strings"),
        (lambda p: p["table"]["shape"].__setitem__(0, 7), "out of range"),
        (lambda p: p["shards"][0].update(size="big"), "malformed shard entry"),
        (lambda p: p["shards"][0].update(size=4097), "malformed shard entry"),
        (lambda p: p["shards"][0].update(file="../escape.bin"), "malformed shard entry"),
        (lambda p: p.update(table=None), "not an object"),
    ],
)
def test_a_malformed_part_fails_naming_its_rank(edit, says):
    bad = copy.deepcopy(part(1))
    edit(bad)
    with pytest.raises(ConfigError, match=f"step 1: rank 1 .*{says}"):
        merge([part(0), bad])


def test_a_part_at_the_wrong_position_is_refused():
    with pytest.raises(ConfigError, match="position 1 is not rank 1's"):
        merge([part(0), part(0)])


def test_a_global_manifest_over_the_cap_names_the_ranks_the_tensors_and_the_cap(monkeypatch):
    from tiersave.format import layout, manifest

    monkeypatch.setattr(layout, "MAX_MANIFEST_BYTES", 1000)
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(FormatError, match="global manifest of 2 ranks and 6 tensors would exceed the 1000-byte cap"):
        encode_global(merge([part(0), part(1)]))


def test_two_ranks_naming_the_same_shard_file_are_refused():
    bad = copy.deepcopy(part(1))
    bad["shards"][0]["file"] = "shard-00000-000.bin"
    with pytest.raises(ConfigError, match="step 1: two ranks sent the same shard file"):
        merge([part(0), bad])


def test_a_part_merges_by_column_name_whatever_their_order():
    shuffled = part(1)
    shuffled["table"] = dict(reversed(list(shuffled["table"].items())))
    assert merge([part(0), shuffled]).tensors == merge([part(0), part(1)]).tensors


def test_a_column_this_version_does_not_write_is_refused_not_dropped():
    """Parts carry no version: a column from another tiersave may hold data a merge must not drop silently."""
    newer = part(1)
    newer["table"]["encoding"] = [0, 0, 0]
    with pytest.raises(ConfigError, match=r"rank 1 sent a malformed tensor table: unknown column\(s\) \['encoding'\]"):
        merge([part(0), newer])
