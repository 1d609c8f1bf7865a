"""One rank's view of a collective manifest (``Manifest.parse(..., part=)``, format/view.py): it is what the whole
parse followed by ``rank_view`` gives, and it refuses every forgery the whole parse refuses that concerns what
the rank reads: a row of ANOTHER rank out of range (the table is checked whole), its own rows, its subtree
reaching outside its part, its own tensors left unreferenced, a damaged seal anywhere in the file."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tiersave.collective import rank_view, view_part
from tiersave.errors import CorruptCheckpointError, FormatError
from tiersave.format.manifest import Manifest, ShardInfo, TensorEntry, seal

CHUNK = 1 << 20
SHARED = 3


def global_manifest(world: int = 3, per_rank: int = 3400) -> Manifest:
    """``world`` ranks' tensors (compact from 10,000 in total), ``SHARED`` replicated ones written by rank 0,
    each rank's subtree referencing its own and the replicated ones."""
    tensors: dict[str, TensorEntry] = {}
    tree: dict[str, Any] = {}
    shards = []
    for r in range(world):
        key = f"rank-{r:05d}"
        count = per_rank + (SHARED if r == 0 else 0)
        shards.append(ShardInfo(f"shard-{r:05d}-000.bin", r, count * 4096))
        model = {}
        for i in range(per_rank):
            name = f"{key}/model.w{i}"
            tensors[name] = TensorEntry(name, "float32", (4,), r, i * 4096, 16, (f"{i:08x}",))
            model[f"w{i}"] = {"$tensor": name}
        if r == 0:
            for j in range(SHARED):
                name = f"replicated/shared.e{j}"
                tensors[name] = TensorEntry(name, "int64", (2,), 0, (per_rank + j) * 4096, 16, (f"{j:08x}",))
        shared = {f"e{j}": {"$tensor": f"replicated/shared.e{j}"} for j in range(SHARED)}
        tree[key] = {"model": model, "shared": shared, "data": {"rank": r}}
    return Manifest(step=7, shards=tuple(shards), tensors=tensors, tree=tree, world_size=world, chunk_bytes=CHUNK)


@pytest.fixture(scope="module")
def data() -> bytes:
    return global_manifest().to_json()


def edited(data: bytes, edit: Any) -> bytes:
    doc = json.loads(data)
    edit(doc)
    return seal(doc)


def row(doc: dict[str, Any], name: str) -> int:
    """The index of tensor ``name`` in a compact table (front-coded names decoded)."""
    shared, suffixes = doc["table"]["names"]
    prev, names = "", []
    for k, s in zip(shared, suffixes, strict=True):
        prev = prev[:k] + s
        names.append(prev)
    return names.index(name)


@pytest.mark.parametrize("small", [False, True], ids=["compact", "per-entry"])
@pytest.mark.parametrize("rank", [0, 2])
def test_the_view_is_the_whole_parse_then_rank_view(rank, small):
    data = global_manifest(per_rank=20 if small else 3400).to_json()
    assert json.loads(data)["format_version"].startswith("1." if small else "4.")
    whole = rank_view(Manifest.parse(data, path="m", expect_step=7), rank, 3)
    view = Manifest.parse(data, path="m", expect_step=7, part=view_part(rank, 3))
    assert view.part == rank and len(view.tensors) < len(Manifest.parse(data, path="m").tensors)
    mine = rank_view(view, rank, 3)
    assert list(mine.tensors.items()) == list(whole.tensors.items())
    assert mine.tree == whole.tree and mine.shards == whole.shards
    assert sum(name.startswith("replicated/") for name in mine.tensors) == SHARED


def test_a_forged_row_of_another_rank_is_refused_by_this_ranks_view(data):
    def far(doc):  # rank 0's tensor w5 moved past the end of its shard (the delta after it moved back)
        i = row(doc, "rank-00000/model.w5")
        doc["table"]["offset"][i] += 1 << 20
        doc["table"]["offset"][i + 1] -= 1 << 20

    forged = edited(data, far)
    with pytest.raises(FormatError, match=re.escape("rank-00000/model.w5")):
        Manifest.parse(forged, path="m", part=view_part(0, 3))
    with pytest.raises(FormatError, match=re.escape("rank-00000/model.w5")):  # not rank 2's row, still refused
        Manifest.parse(forged, path="m", part=view_part(2, 3))


def test_its_own_rows_are_checked(data):
    def bad_crc(doc):
        doc["table"]["crc32c"] = doc["table"]["crc32c"][:-8]

    with pytest.raises(FormatError, match="crc32c"):
        Manifest.parse(edited(data, bad_crc), path="m", part=view_part(1, 3))


def test_the_seal_covers_the_other_ranks_bytes(data):
    text = data.decode()
    at = text.index('"rank-00002"')  # a rank-2 key in the tree: damage outside rank 1's part
    damaged = (text[:at] + '"rank-00003"' + text[at + len('"rank-00002"') :]).encode()
    with pytest.raises(FormatError, match="does not match its checksum"):
        Manifest.parse(damaged, path="m", part=view_part(1, 3))


def test_a_run_reaching_into_another_ranks_rows_is_refused(data):
    def steal(doc):  # rank 1's run of model tensors pointed at rank 2's rows, its prefix to match them
        run = doc["tree"]["rank-00001"]["model"]["$tensors"]
        run[0], run[1] = "rank-00002/model.", row(doc, "rank-00002/model.w0")
        doc["tree"]["rank-00002"]["model"] = {"w0": {"$tensor": "rank-00002/model.w0"}}

    with pytest.raises(FormatError, match="outside its part"):
        Manifest.parse(edited(data, steal), path="m", part=view_part(1, 3))


def test_a_leaf_naming_another_ranks_tensor_is_refused(data):
    def leaf(doc):
        doc["tree"]["rank-00001"]["data"]["x"] = {"$tensor": "rank-00002/model.w1"}

    with pytest.raises(FormatError, match=re.escape("unknown tensor 'rank-00002/model.w1'")):
        Manifest.parse(edited(data, leaf), path="m", part=view_part(1, 3))


def test_its_own_tensor_left_unreferenced_is_refused(data):
    def orphan(doc):
        run = doc["tree"]["rank-00001"]["model"]["$tensors"]
        run[2] -= 1  # the run's last tensor is no longer in the tree

    with pytest.raises(FormatError, match="never uses"):
        Manifest.parse(edited(data, orphan), path="m", part=view_part(1, 3))


def test_a_rank_missing_from_the_tree_is_named(data):
    with pytest.raises(FormatError, match="no state for rank 1"):
        Manifest.parse(edited(data, lambda d: d["tree"].pop("rank-00001")), path="m", part=view_part(1, 3))


def test_other_world_sizes_and_single_rank_checkpoints_parse_whole(data):
    whole = Manifest.parse(data, path="m", part=view_part(5, 8))  # no rank 5: rank_view names both sizes
    assert whole.part is None and len(whole.tensors) == 3 * 3400 + SHARED
    single = Manifest(step=1, shards=(), tensors={}, tree={"x": 1}).to_json()
    assert Manifest.parse(single, path="m", part=view_part(0, 2)).part is None


def test_a_view_is_never_written_and_never_another_ranks(data):
    view = Manifest.parse(data, path="m", part=view_part(1, 3))
    with pytest.raises(FormatError, match="rank 1's view"):
        view.to_json()
    with pytest.raises(CorruptCheckpointError, match="no state for rank 2"):
        rank_view(view, 2, 3)


def test_its_own_subtree_is_depth_checked(data):
    def deep(doc):
        node: Any = 1
        for _ in range(600):
            node = [node]
        doc["tree"]["rank-00001"]["data"]["deep"] = node

    with pytest.raises(FormatError, match="nested deeper than 512"):
        Manifest.parse(edited(data, deep), path="m", part=view_part(1, 3))


def test_a_view_of_a_per_entry_table_of_a_newer_minor_checks_every_rows_range():
    # an unknown field in every entry sends the parse down the per-entry path; another rank's row is forged
    def forge(doc: dict[str, Any]) -> None:
        doc["format_version"] = "1.9"
        for entry in doc["tensors"].values() if isinstance(doc["tensors"], dict) else doc["tensors"]:
            entry["future_field"] = 1
        entries = doc["tensors"]
        bad = (
            entries["rank-00002/model.w0"]
            if isinstance(entries, dict)
            else next(e for e in entries if e["name"] == "rank-00002/model.w0")
        )
        bad["offset"] = 4096 * 10**6

    data = edited(global_manifest(per_rank=20).to_json(), forge)
    with pytest.raises(FormatError, match=r"rank-00002/model\.w0"):
        Manifest.parse(data, path="m", part=view_part(0, 3))


@pytest.mark.parametrize("small", [False, True], ids=["compact", "per-entry"])
def test_a_view_counts_its_subtrees_depth_from_the_whole_trees_root(small):
    def deepen(doc: dict[str, Any]) -> None:
        node = doc["tree"]["rank-00000"]["data"]
        for _ in range(127):
            node["d"] = {}
            node = node["d"]

    data = edited(global_manifest(per_rank=20 if small else 3400).to_json(), deepen)
    with pytest.raises(FormatError, match="nested deeper"):
        Manifest.parse(data, path="m")
    with pytest.raises(FormatError, match="nested deeper"):
        Manifest.parse(data, path="m", part=view_part(0, 3))


def test_a_whole_tree_that_is_no_dict_has_no_state_for_any_rank():
    # a whole manifest of several ranks whose tree is not a dict of rank subtrees (forged or foreign): no rank
    # may take the whole tree as its own
    whole = Manifest(step=1, shards=(), tensors={}, tree=[1, 2], world_size=3)
    with pytest.raises(CorruptCheckpointError, match="no state for rank 1"):
        rank_view(whole, 1, 3)
