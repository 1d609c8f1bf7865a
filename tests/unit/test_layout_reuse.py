"""Reusing the previous save's layout (savelayout.py, reflatten.py): a save of a state with the previous save's
structure replays its flatten and reuses its plan; every change of structure is caught and laid out afresh.

What must hold: a replay gives exactly what a full flatten gives (names, ties, dtypes, shapes, addresses, the
tree); it refuses every change that flatten would see differently (a shape, a dtype, a tensor replaced by one
over other memory, a key added, removed or renamed, a tie made or broken, a tensor that became a plain value
or the reverse, a transposed view, an array); plain values are read afresh at every save; the cache keeps no
tensor alive; and saves through the Checkpointer restore bit-exact whatever changed between them.
"""

from __future__ import annotations

import gc
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tiersave import Checkpointer
from tiersave.errors import ConfigError, UnsupportedStateError
from tiersave.knobs import override_env
from tiersave.reflatten import flatten_layout, reflatten
from tiersave.savelayout import LayoutCache
from tiersave.state import FlatState, flatten


def base_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    shared = torch.randn(6)
    return {
        "model": model,
        "optim": optim,
        "experts": {f"e{i}": torch.randn(16) for i in range(40)},
        "tied": {"a": shared, "b": shared, "view": shared[2:5]},
        "listed": [torch.arange(5), {"x": torch.ones(2, 3)}],
        "step": 7,
        "rng": {"seed": 3, "name": "x"},
        "sd": model.state_dict(),  # an OrderedDict with torch's _metadata: wrapped in a $statedict tag
        "keyed": {1: torch.randn(3), 2.5: torch.randn(2), (1, "a"): torch.randn(2), None: torch.ones(1)},
        "records": {i: {"m": torch.randn(4), "v": torch.randn(4)} for i in range(6)},  # like an optimizer's state
        "square": torch.randn(3, 3),
        "complex": torch.randn(4, dtype=torch.complex64),
        "ids": list(range(10)),
        "pair": [torch.randn(2), torch.randn(2)],
        "ints": {1: torch.randn(2), 2: torch.randn(2)},  # int keys alone: compared by value and class
        "strided": torch.randn(64).as_strided((4, 4), (8, 2)),
    }


class StrKey(str):
    """A str subclass: equal to its text, but a dict key the flatten refuses."""


def same_flat(a: FlatState, b: FlatState) -> None:
    assert a.tree == b.tree
    assert [(t.name, t.dtype, tuple(t.shape), t.nbytes, t.address) for t in a.tensors] == [
        (t.name, t.dtype, tuple(t.shape), t.nbytes, t.address) for t in b.tensors
    ]
    assert all(x.source is y.source or x.source.data_ptr() == y.source.data_ptr() for x, y in zip(a.tensors, b.tensors))


def test_a_replay_gives_what_a_full_flatten_gives_and_reads_plain_values_afresh():
    state = base_state()
    _, layout = flatten_layout(state)
    assert layout is not None
    state["step"] = 8  # plain values change between saves
    state["rng"]["name"] = "y"
    replayed = reflatten(state, layout)
    assert replayed is not None
    same_flat(replayed, flatten(state))
    assert replayed.tree["step"] == 8 and replayed.tree["rng"]["name"] == "y"
    assert {t.name for t in replayed.tensors} >= {"tied.a", "experts.e0", "model.0.weight"}


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "shape": lambda s: s["experts"].__setitem__("e3", torch.randn(17)),
    "dtype": lambda s: s["experts"].__setitem__("e3", s["experts"]["e3"].double()),
    "replaced tensor (other memory, same shape)": lambda s: s["experts"].__setitem__("e3", torch.randn(16)),
    "in-place resize": lambda s: s["experts"]["e5"].resize_(4, 4),
    "in-place set_": lambda s: s["experts"]["e5"].set_(torch.randn(16)),
    "parameter .data replaced": lambda s: setattr(s["model"][0], "weight", torch.nn.Parameter(torch.randn(8, 4))),
    "new key": lambda s: s["experts"].__setitem__("e40", torch.randn(16)),
    "removed key": lambda s: s["experts"].pop("e39"),
    "renamed key": lambda s: s["experts"].__setitem__("z", s["experts"].pop("e0")),
    "tie broken": lambda s: s["tied"].__setitem__("b", s["tied"]["b"].clone()),
    "tie made": lambda s: s["experts"].__setitem__("e2", s["experts"]["e1"]),
    "tensor became a number": lambda s: s["experts"].__setitem__("e4", 4.0),
    "number became a tensor": lambda s: s.__setitem__("step", torch.tensor(8)),
    "transposed view": lambda s: s["listed"][1].__setitem__("x", s["listed"][1]["x"].t()),
    "array added": lambda s: s.__setitem__("arr", np.zeros(3)),
    "nested container added": lambda s: s["rng"].__setitem__("more", {"t": torch.ones(1)}),
    "list grew": lambda s: s["listed"].append(torch.zeros(1)),
    "parameter .data assigned": lambda s: setattr(s["model"][1].weight, "data", torch.randn(2, 8)),
    "neg view": lambda s: s["experts"].__setitem__("e6", s["experts"]["e6"]._neg_view()),
    "conj view": lambda s: s.__setitem__("complex", s["complex"].conj()),
    "other strides (same shape and memory)": lambda s: s.__setitem__(
        "strided", s["strided"].as_strided((4, 4), (16, 1))
    ),
    "transposed square (same shape and memory)": lambda s: s.__setitem__("square", s["square"].t()),
    "dict became an OrderedDict": lambda s: s.__setitem__("experts", OrderedDict(s["experts"])),
    "_metadata dropped": lambda s: s.__setitem__("sd", dict(s["sd"])),
    "_metadata added": lambda s: s.__setitem__("experts", _with_metadata(s["experts"])),
    "list became a tuple": lambda s: s.__setitem__("pair", tuple(s["pair"])),
    "int key became a bool": lambda s: s.__setitem__("ints", _rekeyed(s["ints"], 1, True)),
    "int key became a bool among other keys": lambda s: s.__setitem__("keyed", _rekeyed(s["keyed"], 1, True)),
    "float key 2.5 became an int": lambda s: s.__setitem__("keyed", _rekeyed(s["keyed"], 2.5, 2)),
    "tuple key item became a float": lambda s: s.__setitem__("keyed", _rekeyed(s["keyed"], (1, "a"), (1.0, "a"))),
    "record gained a key": lambda s: s["records"][3].__setitem__("w", torch.randn(4)),
    "record lost a key": lambda s: s["records"][3].pop("v"),
    "record became a list": lambda s: s["records"].__setitem__(2, list(s["records"][2].values())),
    "record value became a number": lambda s: s["records"][5].__setitem__("m", 1.0),
    "record reordered": lambda s: s["records"].__setitem__(1, {"v": s["records"][1]["v"], "m": s["records"][1]["m"]}),
    "optimizer state gained a tensor": lambda s: next(iter(s["optim"].state.values())).__setitem__("x", torch.ones(1)),
    "stateful object replaced by its state": lambda s: s.__setitem__("optim", s["optim"].state_dict()),
    "tensor replaced by a parameter over it": lambda s: s["experts"].__setitem__(
        "e7", torch.nn.Parameter(s["experts"]["e7"])
    ),
}


def _with_metadata(d: dict[str, Any]) -> OrderedDict[str, Any]:
    out: OrderedDict[str, Any] = OrderedDict(d)
    out._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return out


def _rekeyed(d: dict[Any, Any], old: Any, new: Any) -> dict[Any, Any]:
    return {(new if k == old and type(k) is type(old) else k): v for k, v in d.items()}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_of_structure_is_refused_and_a_full_flatten_follows(change):
    state = base_state()
    _, layout = flatten_layout(state)
    assert layout is not None
    CHANGES[change](state)
    assert reflatten(state, layout) is None, f"{change}: the replay accepted a changed structure"
    _, again = flatten_layout(state)  # and the changed state has a layout of its own, which replays
    if again is not None:
        replayed = reflatten(state, again)
        assert replayed is not None
        same_flat(replayed, flatten(state))


def test_a_state_with_arrays_or_empty_tensors_has_no_layout():
    assert flatten_layout({"a": np.zeros(3)})[1] is None
    assert flatten_layout({"a": torch.empty(0)})[1] is None
    assert flatten_layout({"a": torch.ones(2)})[1] is not None


def test_the_cache_keeps_no_tensor_alive():
    cache = LayoutCache(0, 1)
    big = torch.randn(1000)
    ref = weakref.ref(big)
    for _ in range(2):  # the second call reuses the first's layout and plan
        lay = cache.layout(
            {"w": big, "step": 1}, (), collective=False, chunk_for=lambda n: 1 << 20, max_shard_bytes=None
        )
    assert lay.reused and lay.tensors[0].source is big
    del big, lay
    gc.collect()
    assert ref() is None


def _stats_reused(handle: Any) -> bool:
    return bool(handle.stats.extra.get("layout_reused"))


def test_saves_restore_bit_exact_across_every_change_and_reuse_only_when_nothing_changed(tmp_path: Path):
    state = base_state()
    saved: dict[int, dict[str, Any]] = {}
    with Checkpointer(tmp_path, keep_last=100, event_log=False, handle_sigterm=False) as ckpt:
        step = 0

        def save(expect_reuse: bool) -> None:
            nonlocal step
            step += 1
            state["counter"] = step
            handle = ckpt.save_async(step, state)
            saved[step] = flatten_copy(state)  # what the state held when save_async returned
            handle.result(60)
            assert _stats_reused(handle) is expect_reuse, (step, expect_reuse)

        save(False)
        for change in sorted(CHANGES):
            if change == "array added":
                continue  # a state with arrays is never replayed: covered above
            with torch.no_grad():  # new values in every tensor: a reuse must still copy this save's bytes
                for t in flatten(state).tensors:
                    if t.source.dtype.is_floating_point:
                        t.source.add_(1.0)
            save(True)
            CHANGES[change](state)
            save(False)
        for s, expected in saved.items():
            restored = ckpt.restore(s)
            got = flatten_copy(restored)
            assert got.keys() == expected.keys(), s
            for name, value in expected.items():
                assert torch.equal(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value


def flatten_copy(state: Any) -> dict[str, Any]:
    """Each tensor of ``state`` by its flattened name (copied), and the save counter (a plain value)."""
    flat = flatten(state)
    out: dict[str, Any] = {t.name: torch.as_tensor(t.source).clone() for t in flat.tensors}
    out["$counter"] = state["counter"]
    return out


def test_reuse_can_be_turned_off(tmp_path):
    state = {"w": torch.ones(4), "step": 0}
    with override_env("TIERSAVE_REUSE_LAYOUT", "0"), Checkpointer(tmp_path, event_log=False) as ckpt:
        ckpt.save(1, state)
        assert not _stats_reused(ckpt.save(2, state))
    with Checkpointer(tmp_path / "on", event_log=False) as ckpt:
        ckpt.save(1, state)
        assert _stats_reused(ckpt.save(2, state))


def test_a_reused_selection_still_checks_the_declared_keys_against_the_state():
    """Plain values are read afresh at every save: a declared replicated key holding only a plain value may be
    gone while every tensor is where it was, and the reused layout must refuse it as a fresh one would."""
    cache = LayoutCache(0, 2)
    w = torch.randn(1000)

    def lay(state: dict[str, Any]) -> Any:
        return cache.layout(state, ("w", "step"), collective=True, chunk_for=lambda n: 1 << 20, max_shard_bytes=None)

    lay({"w": w, "step": 1})
    assert lay({"w": w, "step": 2}).reused
    with pytest.raises(ConfigError, match=r"replicated key\(s\) \['step'\] are not in the state"):
        lay({"w": w})


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.__setitem__("experts", _rekeyed(s["experts"], "e0", StrKey("e0"))),  # equal to "e0", refused
        lambda s: s["rng"].__setitem__("seed", object()),  # where a plain value was
        lambda s: s["records"].__setitem__(0, _rekeyed(s["records"][0], "m", StrKey("m"))),
    ],
    ids=["str subclass key", "unsupported plain value", "str subclass key in a record"],
)
def test_what_a_full_flatten_refuses_is_refused_after_a_reuse_too(tmp_path: Path, change: Any) -> None:
    """A replay accepts only what the flatten would: a state it cannot save raises the flatten's own error."""
    state = base_state()
    _, layout = flatten_layout(state)
    assert layout is not None
    change(state)
    assert reflatten(state, layout) is None
    with pytest.raises(UnsupportedStateError):
        flatten(state)
    state = base_state()
    with Checkpointer(tmp_path, event_log=False, handle_sigterm=False) as ckpt:
        ckpt.save(1, state)
        assert _stats_reused(ckpt.save(2, state))
        change(state)
        with pytest.raises(UnsupportedStateError):
            ckpt.save_async(3, state)


def test_a_replayed_tree_shares_only_what_names_tensors_and_reads_plain_values_afresh() -> None:
    """The encodings of containers of tensors are reused from save to save; those holding plain values are
    made anew, so a save's tree never changes under an earlier save's manifest."""
    state = base_state()
    first, layout = flatten_layout(state)
    assert layout is not None
    state["rng"]["seed"] = 4
    state["ids"].append(10)
    again = reflatten(state, layout)
    assert again is not None
    assert again.tree["experts"] is first.tree["experts"]  # tensors only: the same encoding
    assert again.tree is not first.tree and again.tree["rng"] is not first.tree["rng"]
    assert first.tree["rng"]["seed"] == 3 and again.tree["rng"]["seed"] == 4
    assert first.tree["ids"] == list(range(10)) and again.tree["ids"] == list(range(11))
    assert again.tree == flatten(state).tree
