"""Checkpointer API semantics: listing, lookup by step and tag, errors, retention, atomicity on failure."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch

import tiersave
from helpers import assert_same, listing
from tiersave.errors import NoSpaceError, StorageError
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import Fault, FaultyStorage


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 33, generator=g), "b": torch.randn(7, generator=g), "step": step}


def test_save_list_latest_info(root):
    with tiersave.Checkpointer(root) as ckpt:
        assert ckpt.list() == [] and ckpt.latest() is None
        for step in (10, 30, 20):
            info = ckpt.save(step, state_for(step), metrics={"loss": 1 / step}, tags=["even"]).result()
            assert info.step == step and info.metrics == {"loss": 1 / step} and info.tags == ("even",)
        assert [i.step for i in ckpt.list()] == [10, 20, 30]
        assert ckpt.latest().step == 30
        info = ckpt.info(20)
        assert info.num_tensors == 2 and info.tensor_bytes == (64 * 33 + 7) * 4
        assert info.stored_bytes % 4096 == 0 and info.location.endswith("step-0000000020")
    assert listing(root) == ["step-0000000010", "step-0000000020", "step-0000000030"]


def test_restore_newest_by_default_and_by_step_or_tag(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state_for(1), tags=["milestone"])
        ckpt.save(2, state_for(2), tags=["best"])
        ckpt.save(3, state_for(3))
        assert_same(ckpt.restore(), state_for(3))
        assert_same(ckpt.restore(1), state_for(1))
        assert_same(ckpt.restore(tag="best"), state_for(2))
        assert ckpt.last_restore.step == 2
        with pytest.raises(tiersave.CheckpointNotFoundError, match="no checkpoint of step 7"):
            ckpt.restore(7)
        with pytest.raises(tiersave.CheckpointNotFoundError, match="no checkpoint tagged 'nope'"):
            ckpt.restore(tag="nope")
        with pytest.raises(tiersave.CheckpointNotFoundError, match="is not tagged 'best'"):
            ckpt.restore(1, tag="best")


def test_restore_on_empty_root_is_a_clear_error(root):
    with (
        tiersave.Checkpointer(root) as ckpt,
        pytest.raises(tiersave.CheckpointNotFoundError, match="no committed checkpoint"),
    ):
        ckpt.restore()


def test_a_committed_step_is_never_overwritten(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(5, state_for(5))
        with pytest.raises(tiersave.AlreadyExistsError, match="step 5 is already committed"):
            ckpt.save(5, state_for(6))
        assert_same(ckpt.restore(5), state_for(5))
        assert not [p for p in root.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"step": -1}, "step must be an integer"),
        ({"step": 1.5}, "step must be an integer"),
        ({"step": True}, "step must be an integer"),
        ({"step": 2**63}, "step must be an integer"),
        ({"metrics": {"loss": float("nan")}}, "metric 'loss' must be a finite number"),
        ({"metrics": {"loss": "low"}}, "metric 'loss' must be a finite number"),
        ({"tags": ["has space"]}, "tag 'has space' must match"),
        ({"tags": ["../x"]}, "tag '../x' must match"),
        ({"metadata": {"f": object()}}, "metadata must be plain JSON"),
        ({"metadata": {"x": float("inf")}}, "metadata must be plain JSON"),
    ],
)
def test_bad_save_arguments_are_config_errors(root, kwargs, fragment):
    args = {"step": 1, **kwargs}
    with tiersave.Checkpointer(root) as ckpt:
        with pytest.raises(tiersave.ConfigError, match=fragment.replace("(", r"\(")):
            ckpt.save(args.pop("step"), state_for(1), **args)
        assert ckpt.list() == []


def test_tensor_metric_and_tag_string_are_accepted(root):
    with tiersave.Checkpointer(root) as ckpt:
        info = ckpt.save(1, state_for(1), metrics={"loss": torch.tensor(0.5)}, tags="best").result()
    assert info.metrics == {"loss": 0.5} and info.tags == ("best",)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"keep_last": 0}, "keep_last"),
        ({"io_threads": 0}, "io_threads"),
        ({"chunk_bytes": 1000}, "chunk_bytes"),
        ({"max_shard_bytes": 10}, "max_shard_bytes"),
    ],
)
def test_bad_constructor_arguments(root, kwargs, fragment):
    with pytest.raises(tiersave.ConfigError, match=fragment):
        tiersave.Checkpointer(root, **kwargs)


def test_root_that_is_a_file_is_rejected(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(tiersave.ConfigError, match="exists and is not a directory"):
        tiersave.Checkpointer(f)


def test_closed_checkpointer_refuses_work(root):
    ckpt = tiersave.Checkpointer(root)
    ckpt.close()
    ckpt.close()
    with pytest.raises(tiersave.ConfigError, match="closed"):
        ckpt.save(1, state_for(1))


def test_keep_last_retention_runs_after_each_commit(root):
    with tiersave.Checkpointer(root, keep_last=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step, state_for(step))
            assert [i.step for i in ckpt.list()] == list(range(max(1, step - 1), step + 1))


def test_small_chunks_and_many_shards(root):
    state = {f"t{i}": torch.randn(3000 + i) for i in range(12)}
    with tiersave.Checkpointer(root, chunk_bytes=4096, max_shard_bytes=20_000, io_threads=3) as ckpt:
        ckpt.save(1, state)
        m = ckpt.catalog.manifest(1)
        assert len(m.shards) > 3
        assert all(len(t.crc32c) == -(-t.nbytes // 4096) for t in m.tensors.values())
        assert_same(ckpt.restore(), state)
        assert ckpt.verify(1).ok


def test_strict_restore_into_reports_what_is_missing_or_wrong(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"w": torch.zeros(3), "x": 1})
        with pytest.raises(tiersave.StateMismatchError, match="the checkpoint has no 'extra'"):
            ckpt.restore(into={"w": torch.zeros(3), "x": 0, "extra": torch.zeros(1)})
        with pytest.raises(tiersave.StateMismatchError, match=r"w: the live value is float32\[4\]"):
            ckpt.restore(into={"w": torch.zeros(4), "x": 0})
        with pytest.raises(tiersave.StateMismatchError, match="float64"):
            ckpt.restore(into={"w": torch.zeros(3, dtype=torch.float64), "x": 0})
        state = {"w": torch.ones(3), "x": 0, "extra": 5}
        ckpt.restore(into=state, strict=False)
        assert state == {"w": state["w"], "x": 1, "extra": 5} and state["w"].sum() == 0


def test_load_state_dict_rejection_is_a_state_mismatch(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(4, 3)})
        with pytest.raises(tiersave.StateMismatchError, match=r"Linear\.load_state_dict rejected the checkpoint"):
            ckpt.restore(into={"model": torch.nn.Linear(5, 3)})


def test_model_state_dict_restores_into_a_model(root):
    model = torch.nn.Linear(4, 3)
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model.state_dict()})
        fresh = torch.nn.Linear(4, 3)
        ckpt.restore(into={"model": fresh})
    assert torch.equal(fresh.weight, model.weight)


def test_corrupt_newest_falls_back_with_a_warning_but_explicit_step_raises(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state_for(1))
        ckpt.save(2, state_for(2))
        shard = root / "step-0000000002" / "shard-00000-000.bin"
        data = bytearray(shard.read_bytes())
        data[100] ^= 0x01
        shard.write_bytes(bytes(data))
        with pytest.warns(tiersave.TiersaveWarning, match="skipping the copy of step 2 on tier local"):
            restored = ckpt.restore()
        assert_same(restored, state_for(1))
        assert ckpt.last_restore.step == 1
        assert ckpt.last_restore.skipped and ckpt.last_restore.skipped[0][0] == 2
        assert (
            "checksum mismatch in step 2, file shard-00000-000.bin, tensor 'w', chunk 0"
            in ckpt.last_restore.skipped[0][1]
        )
        with pytest.raises(tiersave.CorruptCheckpointError, match="checksum mismatch in step 2"):
            ckpt.restore(2)


def test_every_checkpoint_corrupt_raises(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state_for(1))
        (root / "step-0000000001" / "shard-00000-000.bin").write_bytes(b"short")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(tiersave.CorruptCheckpointError, match="every candidate failed"):
                ckpt.restore()


@pytest.mark.parametrize("op", ["open_writer", "write_at", "finish", "put", "rename_prefix"])
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_io_error_at_any_write_step_leaves_nothing_visible(root, op, code):
    storage = FaultyStorage(LocalStorage(root))
    with tiersave.Checkpointer(storage, io_threads=2) as ckpt:
        ckpt.save(1, state_for(1))
        storage.faults = [Fault(op, storage.ops[op] + 1, lambda: OSError(code, os.strerror(code)))]
        expected = NoSpaceError if code == errno.ENOSPC else StorageError
        with pytest.raises(expected, match="injected"):
            ckpt.save(2, state_for(2))
        assert [i.step for i in ckpt.list()] == [1]
        assert_same(ckpt.restore(), state_for(1))
        assert ckpt.verify(1).ok
        # the failed save's files are gone; the next save of the same step works
        assert listing(root) == ["step-0000000001"]
        storage.faults.clear()
        ckpt.save(2, state_for(2))
        assert_same(ckpt.restore(), state_for(2))


def test_nth_write_error_sweep_never_loses_the_previous_checkpoint(root):
    storage = FaultyStorage(LocalStorage(root))
    with tiersave.Checkpointer(storage, chunk_bytes=4096, io_threads=2) as ckpt:
        ckpt.save(1, state_for(1))
        total_ops = storage.total
        for n in range(1, total_ops + 1):
            storage.faults = [Fault("*", storage.total + n)]
            try:
                ckpt.save(2, state_for(2))
            except StorageError:
                pass
            else:
                ckpt.catalog.delete(2)  # the fault landed past the commit (e.g. on a listing); start over
            assert ckpt.catalog.steps() == [1]
            assert_same(ckpt.restore(1), state_for(1))
        storage.faults = []
        assert listing(root) == ["step-0000000001"]
