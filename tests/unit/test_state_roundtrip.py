"""Save/restore round trips of every supported kind of value, bit for bit."""

from __future__ import annotations

import collections
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiersave
from helpers import assert_same, listing
from tiersave.format.dtypes import DTYPES


def roundtrip(root, state, step=1):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(step, state)
        return ckpt.restore(step)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` filled with random bytes (every bit pattern, NaNs included)."""
    numel = math.prod(shape)
    high = 2 if dtype == torch.bool else 256  # a bool byte other than 0/1 is undefined in torch
    raw = torch.randint(0, high, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


TORCH_DTYPES = [getattr(torch, name) for name in DTYPES if isinstance(getattr(torch, name, None), torch.dtype)]


def test_every_format_dtype_exists_in_this_torch():
    # The closed dtype set is exactly torch's non-quantized dtypes, so every one of them is covered below.
    torch_names = {str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
    quantized = {"qint8", "qint32", "quint8", "quint4x2", "quint2x4"}
    assert torch_names - quantized == set(DTYPES)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype_roundtrips(root, dtype):
    gen = torch.Generator().manual_seed(7)
    state = {
        "scalar0d": random_tensor(dtype, (), gen),
        "empty": random_tensor(dtype, (0, 3), gen),
        "matrix": random_tensor(dtype, (5, 7), gen),
        "transposed": random_tensor(dtype, (4, 6), gen).t(),
        "slice_view": random_tensor(dtype, (10, 8), gen)[2:7, 1:5],
        "odd": random_tensor(dtype, (3, 1, 1025), gen),
    }
    assert not state["transposed"].is_contiguous() and not state["slice_view"].is_contiguous()
    restored = roundtrip(root, state)
    assert_same(state, restored)


def test_bool_and_bfloat16_values(root):
    state = {"mask": torch.tensor([True, False, True]), "w": torch.tensor([1.5, -2.25, 3e38], dtype=torch.bfloat16)}
    restored = roundtrip(root, state)
    assert restored["mask"].tolist() == [True, False, True]
    assert restored["w"].dtype == torch.bfloat16 and restored["w"].tolist() == state["w"].tolist()


def test_views_share_nothing_after_restore_but_keep_values(root):
    base = torch.arange(20.0)
    state = {"base": base, "view": base[5:10], "strided": base[::3]}
    restored = roundtrip(root, state)
    assert_same(state, restored)
    restored["view"][0] = 100.0
    assert restored["base"][5] == 5.0  # views are saved as values, documented in docs/format.md


def test_tied_tensors_are_stored_once_and_restore_tied(root):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    with tiersave.Checkpointer(root) as ckpt:
        info = ckpt.save(1, {"model": model}).result()
        assert info.num_tensors == 1  # the two names reference one stored tensor
        fresh = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
        fresh[1].weight = fresh[0].weight
        ckpt.restore(into={"model": fresh})
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert fresh[1].weight is fresh[0].weight


@pytest.mark.parametrize(
    "dtype",
    [
        "float64",
        "float32",
        "float16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint64",
        "uint32",
        "uint16",
        "uint8",
        "bool",
        "complex64",
        "complex128",
    ],
)
def test_numpy_arrays_and_scalars(root, dtype):
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=6 * 4 * np.dtype(dtype).itemsize, dtype=np.uint8)
    arr = raw.view(dtype).reshape(6, 4)
    if dtype == "bool":
        arr = arr.astype(bool)
    state = {
        "arr": arr,
        "fortran": np.asfortranarray(arr),
        "strided": arr[::2, ::3],
        "zero_d": np.array(arr[1, 1]),
        "scalar": arr[2, 3] if dtype != "bool" else np.bool_(True),
        "big_endian": arr.astype(np.dtype(dtype).newbyteorder(">")),
    }
    restored = roundtrip(root, state)
    assert_same(state, restored)
    assert type(restored["scalar"]) is type(state["scalar"])


def test_python_values(root):
    state = {
        "none": None,
        "bools": [True, False],
        "ints": [0, -1, 2**62, -(2**63), 2**100],
        "floats": [0.0, -0.0, 1e-310, 1.7976931348623157e308, math.nan, math.inf, -math.inf, 0.1],
        "str": "ünïcødé ✓ \x00 and \n",
        "bytes": b"\x00\xffbinary",
        "tuple": (1, (2, 3), [4]),
        "nested": {"a": [{"b": ({"c": None},)}]},
        "$tensor": "a user key that looks like a tag",
        "$$x": 1,
        "int_keys": {0: "a", -5: "b", 2**40: "c"},
        "mixed_keys": {None: 1, True: 2, 1.5: 3, "s": 4, (1, "x"): 5},
        "dtype": torch.bfloat16,
        "empty": {"d": {}, "l": [], "t": ()},
    }
    restored = roundtrip(root, state)
    assert_same(state, restored)


def test_ordered_dict_metadata_is_preserved(root):
    sd = torch.nn.BatchNorm1d(3).state_dict()
    assert hasattr(sd, "_metadata")
    restored = roundtrip(root, {"bn": sd})
    assert isinstance(restored["bn"], collections.OrderedDict)
    assert restored["bn"]._metadata == sd._metadata
    assert_same(dict(sd), dict(restored["bn"]))


class Counter:
    """A user object with state_dict/load_state_dict (like a data loader's position)."""

    def __init__(self) -> None:
        self.position = 0
        self.epoch = 0

    def state_dict(self):
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.position, self.epoch = state["position"], state["epoch"]


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).square().mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
    loader = Counter()
    loader.position, loader.epoch = 1234, 3
    return model, optim, sched, loader


def _fresh():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched, Counter()


def test_stateful_objects_restore_into_fresh_ones(root):
    model, optim, sched, loader = _trained()
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(3, {"model": model, "optim": optim, "sched": sched, "loader": loader, "step": 3})
        m2, o2, s2, l2 = _fresh()
        state = {"model": m2, "optim": o2, "sched": s2, "loader": l2, "step": 0}
        out = ckpt.restore(into=state)
    assert out is state and state["step"] == 3
    assert_same(model.state_dict(), m2.state_dict())
    assert_same(optim.state_dict(), o2.state_dict())
    assert sched.state_dict() == s2.state_dict()
    assert (l2.position, l2.epoch) == (1234, 3)


def test_restore_into_reads_in_place_without_copies(root):
    model, optim, _sched, _loader = _trained()
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        m2, o2, _, _ = _trained()  # same shapes, optimizer state already allocated
        with torch.no_grad():
            for p in m2.parameters():
                p.zero_()
        ptrs = [t.data_ptr() for t in m2.state_dict().values()]
        ckpt.restore(into={"model": m2, "optim": o2})
        report = ckpt.last_restore
    assert [t.data_ptr() for t in m2.state_dict().values()] == ptrs
    assert_same(model.state_dict(), m2.state_dict())
    n_model = len(model.state_dict())
    assert report.in_place >= n_model  # every model tensor was read straight into the live parameter


def test_restore_without_into_returns_plain_state(root):
    model, _optim, _, loader = _trained()
    restored = roundtrip(root, {"model": model, "loader": loader})
    assert_same(dict(model.state_dict()), dict(restored["model"]))
    assert restored["loader"] == {"position": 1234, "epoch": 3}


def test_rng_state_restores_every_generator(root):
    gen = torch.Generator().manual_seed(5)
    npgen = np.random.default_rng(9)
    rng = tiersave.RNGState(generators={"sampler": gen, "np": npgen})
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"rng": rng})
        expected = (
            random.random(),
            np.random.rand(),
            torch.rand(1).item(),
            torch.rand(1, generator=gen).item(),
            npgen.random(),
        )
        random.seed(99)
        np.random.seed(99)
        torch.manual_seed(99)
        gen.manual_seed(99)
        npgen2 = np.random.default_rng(99)
        rng2 = tiersave.RNGState(generators={"sampler": gen, "np": npgen2})
        ckpt.restore(into={"rng": rng2})
    got = (
        random.random(),
        np.random.rand(),
        torch.rand(1).item(),
        torch.rand(1, generator=gen).item(),
        npgen2.random(),
    )
    assert got == expected


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (lambda: 1, "cannot save an object of type builtins.function"),
        ({1, 2}, "cannot save an object of type builtins.set"),
        (object(), "cannot save an object of type builtins.object"),
        (torch.randn(3, 3).to_sparse(), "convert with .to_dense()"),
        (torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8), "quantized tensors are not supported"),
        (torch.empty(3, device="meta"), "a meta tensor has no data"),
        (np.array(["a", "b"]), "numpy dtype <U1 is not supported"),
        (np.array([object()], dtype=object), "numpy dtype object is not supported"),
        ({frozenset(): 1}, "dict key frozenset() of type frozenset cannot be saved"),
    ],
    ids=["lambda", "set", "object", "sparse", "quantized", "meta", "np-str", "np-object", "bad-key"],
)
def test_unsupported_values_fail_clearly_and_save_nothing(root, value, fragment):
    with tiersave.Checkpointer(root) as ckpt:
        with pytest.raises(
            tiersave.UnsupportedStateError, match=fragment.replace("(", r"\(").replace(")", r"\)")
        ) as info:
            ckpt.save(1, {"good": torch.ones(2), "bad": {"inner": value}})
        assert info.value.path.startswith("bad.inner")
        assert ckpt.list() == []
    assert listing(root) == []


def test_cycles_are_rejected(root):
    a: list = [1]
    a.append(a)
    with tiersave.Checkpointer(root) as ckpt, pytest.raises(tiersave.UnsupportedStateError, match="cycle"):
        ckpt.save(1, {"a": a})


# -- property-based: random state trees ---------------------------------------------------------------

_HYP_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(_HYP_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    seed = draw(st.integers(0, 2**31))
    t = random_tensor(dtype, shape, torch.Generator().manual_seed(seed))
    if len(shape) >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    return t


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
keys = st.one_of(st.text(max_size=8), st.integers(-5, 5))
trees = st.recursive(
    st.one_of(scalars, tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=trees)
def test_random_state_trees_roundtrip(tmp_path_factory, state):
    root = tmp_path_factory.mktemp("hyp")
    restored = roundtrip(root, {"state": state})
    assert_same({"state": state}, restored)
