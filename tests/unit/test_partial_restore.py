"""Partial and transfer-learning restores: ``into=`` a subset, ``keys=``, ``strict=False`` into modules, dtype casts.

The bytes a restore reads are counted twice: by the restore (``last_restore.bytes_read``) and below it, at the
storage (every ``read_into`` of a real local storage), so "reads only the selected bytes" is measured, not
assumed."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import tiersave
from tiersave.storage.base import BlobReader
from tiersave.storage.posix.local import LocalStorage
from tiersave.testing.faults import FaultyStorage

MB = 1 << 20


class CountingStorage(FaultyStorage):
    """A real local storage that counts the tensor bytes read through it."""

    def __init__(self, inner: LocalStorage) -> None:
        super().__init__(inner)
        self.bytes_read = 0
        self._count_lock = threading.Lock()

    def open_reader(self, key: str) -> BlobReader:
        reader = self.inner.open_reader(key)
        owner = self

        class Counted:
            def __init__(self) -> None:
                self.key, self.size = reader.key, reader.size

            def read_into(self, offset: int, out: memoryview) -> None:
                with owner._count_lock:
                    owner.bytes_read += len(out)
                reader.read_into(offset, out)

            def close(self) -> None:
                reader.close()

        return Counted()  # type: ignore[return-value]


class Net(torch.nn.Module):
    def __init__(self, classes: int = 10, width: int = 512) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
        )
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def big_state() -> dict:
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "step": 7, "extra": torch.randn(1024, 1024)}


def nbytes(module: torch.nn.Module, prefix: str = "") -> int:
    return sum(t.nbytes for k, t in module.state_dict().items() if k.startswith(prefix))


@pytest.fixture
def saved(root):
    """A checkpoint of ``big_state()`` (about 10 MB) and a restoring Checkpointer that counts storage reads."""
    state = big_state()
    with tiersave.Checkpointer(root) as writer:
        writer.save(1, state)
        total = writer.info(1).tensor_bytes
    storage = CountingStorage(LocalStorage(root))
    with tiersave.Checkpointer(storage) as ckpt:
        yield state, ckpt, storage, total


def test_into_a_subset_reads_only_its_bytes_and_adds_no_keys(saved):
    state, ckpt, storage, total = saved
    model = Net()
    into = {"model": model}
    assert ckpt.restore(into=into) is into
    assert list(into) == ["model"]  # no 'optim', 'step', 'extra' added
    for k, v in state["model"].state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    want = nbytes(model)
    assert ckpt.last_restore.bytes_read == want < total / 3
    assert storage.bytes_read < want + 2 * MB  # the storage saw about the model's bytes, not the checkpoint's
    before = storage.bytes_read
    ckpt.restore(into={"step": 0})
    assert ckpt.last_restore.bytes_read == 0 and storage.bytes_read == before


def test_keys_select_a_subtree_without_into(saved):
    state, ckpt, storage, _ = saved
    out = ckpt.restore(keys=["model"])
    assert list(out) == ["model"]
    assert set(out["model"]) == set(state["model"].state_dict())
    assert ckpt.last_restore.bytes_read == nbytes(state["model"])
    enc = ckpt.restore(keys="model.encoder")
    assert sorted(enc["model"]) == sorted(k for k in state["model"].state_dict() if k.startswith("encoder."))
    assert torch.equal(enc["model"]["encoder.0.weight"], state["model"].encoder[0].weight)
    assert ckpt.last_restore.bytes_read == nbytes(state["model"], "encoder.")
    both = ckpt.restore(keys=["model.head", "step", "extra"])
    assert sorted(both) == ["extra", "model", "step"] and both["step"] == 7
    assert sorted(both["model"]) == ["head.bias", "head.weight"]
    before = storage.bytes_read
    with pytest.raises(tiersave.StateMismatchError, match=r"step 1 has no 'model.decoder' \(its top-level keys: model"):
        ckpt.restore(keys=["model.decoder"])
    assert storage.bytes_read == before
    for bad in ([], [""], [3], ".model", 3, {"model"}):
        with pytest.raises(tiersave.ConfigError, match="keys must be"):
            ckpt.restore(keys=bad)


def test_keys_and_into_together_read_the_intersection(saved):
    state, ckpt, _, _ = saved
    model = Net()
    ckpt.restore(keys=["model.encoder"], into={"model": model}, strict=False)
    assert torch.equal(model.encoder[2].weight, state["model"].encoder[2].weight)
    assert not torch.equal(model.head.weight, state["model"].head.weight)  # not selected: untouched
    assert ckpt.last_restore.missing == ["model.head.weight", "model.head.bias"]  # not selected by keys


def test_new_head_takes_the_matching_weights_and_reports_the_rest(saved, caplog):
    state, ckpt, storage, _ = saved
    model = Net(classes=3)
    model.adapter = torch.nn.Linear(4, 4)
    head_before = model.head.weight.detach().clone()
    with pytest.raises(tiersave.StateMismatchError, match="load_state_dict rejected"):
        ckpt.restore(into={"model": model})
    before = storage.bytes_read
    with caplog.at_level(logging.WARNING, logger="tiersave"):
        ckpt.restore(into={"model": model}, strict=False)
    report = ckpt.last_restore
    assert torch.equal(model.encoder[0].weight, state["model"].encoder[0].weight)
    assert torch.equal(model.head.weight, head_before)
    assert report.mismatched == ["model.head.weight", "model.head.bias"]
    assert report.missing == ["model.adapter.weight", "model.adapter.bias"]
    assert report.unexpected == []
    assert report.bytes_read == nbytes(state["model"], "encoder.")  # the old head's bytes were not read
    assert storage.bytes_read - before < report.bytes_read + 2 * MB
    assert "2 shape-mismatched (model.head.weight: checkpoint [10, 512], live [3, 512]" in caplog.text
    small = torch.nn.Module()
    small.encoder = torch.nn.Sequential(torch.nn.Linear(512, 512))
    ckpt.restore(into={"model": small}, strict=False)
    assert ckpt.last_restore.unexpected == [
        "model.encoder.2.weight",
        "model.encoder.2.bias",
        "model.head.weight",
        "model.head.bias",
    ]
    assert torch.equal(small.encoder[0].bias, state["model"].encoder[0].bias)


def test_plain_tensors_with_strict_false_skip_a_shape_mismatch(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.ones(3), "b": torch.ones(2), "n": 4})
        live = {"w": torch.zeros(5), "b": torch.zeros(2), "new": 1}
        with pytest.raises(tiersave.StateMismatchError, match=r"w: the live value is float32\[5\]"):
            ckpt.restore(into={"w": torch.zeros(5), "b": torch.zeros(2)})
        ckpt.restore(into=live, strict=False)
        assert live["w"].sum() == 0 and live["b"].sum() == 2 and live["new"] == 1 and "n" not in live
        assert ckpt.last_restore.mismatched == ["w"] and ckpt.last_restore.missing == ["new"]


def test_a_dtype_mismatch_is_an_error_unless_cast(root):
    torch.manual_seed(1)
    src = Net(width=64)
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": src, "w": torch.randn(8), "count": torch.arange(4)})
        bf16 = Net(width=64).to(torch.bfloat16)
        with pytest.raises(tiersave.StateMismatchError, match=r"model.encoder.0.weight: .*bfloat16.*pass cast=True"):
            ckpt.restore(into={"model": bf16})
        ckpt.restore(into={"model": bf16}, cast=True)
        assert bf16.head.weight.dtype == torch.bfloat16
        assert torch.equal(bf16.head.weight, src.head.weight.to(torch.bfloat16))
        assert "model.head.weight" in ckpt.last_restore.cast
        live = {"w": torch.zeros(8, dtype=torch.float16)}
        ckpt.restore(into=live, cast=True)
        assert live["w"].dtype == torch.float16 and ckpt.last_restore.cast == ["w"]
        with pytest.raises(tiersave.StateMismatchError, match="count"):  # integers are never converted
            ckpt.restore(into={"count": torch.zeros(4)}, cast=True)
        out = ckpt.restore(keys=["model", "count"], dtype=torch.bfloat16)
        assert out["model"]["head.weight"].dtype == torch.bfloat16 and out["count"].dtype == torch.int64
        assert torch.equal(out["model"]["head.weight"], src.head.weight.to(torch.bfloat16))
        with pytest.raises(tiersave.ConfigError, match="dtype must be a floating-point"):
            ckpt.restore(dtype=torch.int8)
