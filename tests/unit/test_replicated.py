"""Replicated state, the parts that need no second process: which tensors a declaration selects, how they are
assigned to ranks, the fingerprints, and rank 0's merge refusing ranks that disagree on the layout."""

from __future__ import annotations

import pytest
import torch

import tiersave
from tiersave.collective import merge_parts, rank_part, rank_view, shared_shards
from tiersave.errors import ConfigError
from tiersave.format.manifest import ShardInfo, TensorEntry
from tiersave.replicated import assign, check_agreement, fingerprints, normalize_keys, select
from tiersave.state import FlatTensor, flatten


def ddp_like() -> dict:
    return {
        "model": {"a": torch.ones(1000), "b": torch.ones(10), "c": torch.ones(600), "d": torch.ones(500)},
        "optim": {"state": {0: {"m": torch.zeros(300)}}, "lr": 0.1},
        "w": torch.zeros(4),
    }


def test_a_declaration_selects_the_tensors_under_its_keys():
    state = ddp_like()
    sel = select(state, flatten(state), ("model", "optim"))
    assert {t.name for t in sel.tensors} == {"model.a", "model.b", "model.c", "model.d", "optim.state.0.m"}
    assert sel.key_of["optim.state.0.m"] == "optim"


@pytest.mark.parametrize(
    ("state", "keys", "match"),
    [
        ({"model": torch.ones(2)}, ("optim",), r"\['optim'\] are not in the state"),
        ([torch.ones(2)], ("model",), "must be a dict with string keys"),
    ],
)
def test_a_declaration_that_does_not_fit_the_state_is_refused(state, keys, match):
    with pytest.raises(ConfigError, match=match):
        select(state, flatten(state), keys)


def test_a_tensor_shared_between_a_replicated_key_and_another_is_refused():
    t = torch.ones(3)
    state = {"model": {"w": t}, "ema": {"w": t}}
    with pytest.raises(ConfigError, match="referenced both under a replicated key"):
        select(state, flatten(state), ("model",))


@pytest.mark.parametrize("bad", ["model", ["model", 3], [""]])
def test_replicated_must_be_a_list_of_keys(bad):
    with pytest.raises(ConfigError, match="replicated"):
        normalize_keys(bad)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_assignment_splits_the_bytes_evenly_and_alike_on_every_rank(world):
    state = ddp_like()
    sel = select(state, flatten(state), ("model", "optim"))
    owner = assign(sel.tensors, world)
    assert owner == assign(tuple(reversed(sel.tensors)), world)  # the order the ranks list them in is irrelevant
    load = [0] * world
    for t in sel.tensors:
        load[owner[t.name]] += t.nbytes
    total, largest = sum(load), max(t.nbytes for t in sel.tensors)
    assert max(load) <= total / world + largest
    assert sum(1 for x in load if x) == min(world, len(sel.tensors))


def test_fingerprints_change_with_one_element_and_name_the_key():
    a = ddp_like()
    b = ddp_like()
    b["model"]["c"][599] = 2.0
    pa = fingerprints(select(a, flatten(a), ("model", "optim")))
    pb = fingerprints(select(b, flatten(b), ("model", "optim")))
    assert pa["optim"] == pb["optim"] and pa["model"] != pb["model"]
    check_agreement([pa, pa], step=3)
    with pytest.raises(ConfigError, match=r"step 3: .*'model' differs on rank\(s\) \[1\] from rank 0"):
        check_agreement([pa, pb, pa], step=3)


def test_a_single_process_checks_the_declaration_and_saves_everything(tmp_path):
    with tiersave.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ConfigError, match="not in the state"):
            ckpt.save(1, ddp_like(), replicated=["optimizer"])
        ckpt.save(1, ddp_like(), replicated=["model", "optim"])
        assert torch.equal(ckpt.restore()["model"]["a"], torch.ones(1000))


def part(rank: int, digest: str, names: dict[str, int]) -> dict:
    """A rank's vote for a state {"model": {name: tensor}, "w": tensor} where it wrote ``names`` (name -> bytes)."""
    from tiersave.replicated import Selection

    tensors = {"w": TensorEntry("w", "float32", (1,), 0, 0, 4, ("0" * 8,))}
    offset = 4096
    for name, n in names.items():
        tensors[name] = TensorEntry(name, "float32", (n // 4,), 0, offset, n, ("0" * 8,))
        offset += 4096
    mine = tuple(FlatTensor(n, "float32", (b // 4,), b, torch.zeros(b // 4)) for n, b in names.items())
    sel = Selection(("model",), mine, digest, {})
    tree = {"model": {"x": {"$tensor": "model.x"}, "y": {"$tensor": "model.y"}}, "w": {"$tensor": "w"}}
    doc = rank_part(rank, [ShardInfo(f"shard-{rank:05d}-000.bin", rank, offset)], tensors, tree, sel)
    doc["replicated"]["count"] = 2
    return doc


def merge(parts: list) -> object:
    return merge_parts(5, parts, chunk_bytes=1 << 20, metrics={}, tags=(), metadata={}, stats={})


def test_rank_zero_merges_replicated_tensors_once_and_each_rank_sees_them():
    manifest = merge([part(0, "d", {"model.x": 8}), part(1, "d", {"model.y": 4})])
    assert sorted(manifest.tensors) == ["rank-00000/w", "rank-00001/w", "replicated/model.x", "replicated/model.y"]
    assert manifest.shards[manifest.tensors["replicated/model.y"].shard].rank == 1
    view = rank_view(manifest, 0, 2)
    assert sorted(view.tensors) == ["rank-00000/w", "replicated/model.x", "replicated/model.y"]
    assert view.tree["model"]["y"] == {"$tensor": "replicated/model.y"} and view.tree["w"] == {
        "$tensor": "rank-00000/w"
    }


def test_every_rank_reads_the_replicated_shards_in_the_same_order_and_shares_them():
    """Rank r's view lists its own tensors, then the replicated ones in the same order on every rank (by the
    rank that wrote them), so the ranks of a node read the same file regions together; the shards holding
    replicated tensors are the shared ones."""
    manifest = merge([part(0, "d", {"model.x": 8}), part(1, "d", {"model.y": 4})])
    for rank in (0, 1):
        view = rank_view(manifest, rank, 2)
        assert list(view.tensors) == [f"rank-{rank:05d}/w", "replicated/model.x", "replicated/model.y"]
        assert shared_shards(view) == {0, 1}
    w = {"w": TensorEntry("w", "float32", (1,), 0, 0, 4, ("0" * 8,))}
    parts = [rank_part(r, [ShardInfo(f"shard-{r:05d}-000.bin", r, 4096)], w, {"$tensor": "w"}) for r in (0, 1)]
    assert shared_shards(rank_view(merge(parts), 1, 2)) == frozenset()  # nothing replicated: nothing shared


def test_rank_zero_refuses_ranks_that_disagree_on_the_replicated_layout():
    with pytest.raises(ConfigError, match=r"rank\(s\) \[1\] declared other replicated state"):
        merge([part(0, "d", {"model.x": 8}), part(1, "other", {"model.y": 4})])
    with pytest.raises(ConfigError, match="wrote 1 of the 2 replicated tensors"):
        merge([part(0, "d", {"model.x": 8}), part(1, "d", {})])
    with pytest.raises(ConfigError, match=r"'replicated/model\.x' was written by more than one rank"):
        merge([part(0, "d", {"model.x": 8}), part(1, "d", {"model.x": 8})])
