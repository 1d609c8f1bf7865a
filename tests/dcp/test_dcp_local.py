"""tiersave.dcp in one process: round trips on a local path, mem:// and S3, corruption, hostile metadata,
the unpickle policies and argument checks. (Several ranks: test_dcp_dist.py.)"""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tiersave.cli import main as cli
from tiersave.dcp import Reader, Writer, export_safetensors
from tiersave.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    SaveError,
    UnsupportedStateError,
)
from tiersave.format.manifest import seal
from tiersave.storage import open_storage

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns on every call that it runs without a process group
        yield


class Custom:
    """An object of a class torch's restricted unpickler does not know."""

    def __init__(self, value: int) -> None:
        self.value = value


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    model(torch.randn(4, 40)).sum().backward()
    opt.step()
    return model, opt


def state(seed: int) -> dict[str, Any]:
    model, opt = model_and_optimizer(seed)
    g = torch.Generator().manual_seed(seed)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {
            "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
            "int": torch.randint(0, 1000, (33,), generator=g),
            "bool": torch.rand(9, generator=g) > 0.5,
            "scalar": torch.tensor(float(seed)),
            "empty": torch.empty(0, 4),
            "strided": torch.randn(6, 8, generator=g).t(),  # not contiguous
            "epoch": seed,
            "name": f"run-{seed}",
        },
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, path


def save(root: Any, step: int, sd: dict[str, Any], **kwargs: Any) -> None:
    dcp.save(sd, storage_writer=Writer(root, step=step, **kwargs))


def load(root: Any, sd: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    dcp.load(sd, storage_reader=Reader(root, **kwargs))
    return sd


def failure(exc: pytest.ExceptionInfo[CheckpointException]) -> BaseException:
    """DCP wraps each rank's error: the tiersave error of rank 0."""
    return exc.value.failures[0][0]  # type: ignore[no-any-return]


@pytest.fixture
def mem_root() -> Iterator[str]:
    uri = f"mem://dcp-test-{uuid.uuid4().hex[:12]}"
    yield uri
    open_storage(uri).destroy()  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["local", "mem"])
def test_round_trip_model_optimizer_and_values(where: str, root: Path, mem_root: str) -> None:
    target = str(root) if where == "local" else mem_root
    saved = state(0)
    save(target, 10, saved, chunk_bytes=4096)  # small chunks: several checksums per tensor
    loaded = load(target, state(1))
    assert_same(saved, loaded)
    reader = Reader(target)
    assert reader.step == 10 and reader.manifest.world_size == 1
    assert "model.0.weight" in reader.manifest.tensors  # an unsharded tensor keeps its name
    assert len(reader.manifest.tensors["model.0.weight"].crc32c) == 3  # 64*40*4 bytes in 4 KiB chunks


@pytest.mark.s3
def test_round_trip_on_s3(s3_storage: Any) -> None:
    saved = state(0)
    save(s3_storage, 3, saved)
    assert_same(saved, load(s3_storage, state(1)))
    files = [s.file for s in Reader(s3_storage).manifest.shards]
    assert len(files) == 1 and files[0].startswith("attempt-")  # marker commit: a per-attempt prefix


def test_cli_sees_a_dcp_checkpoint(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save(root, 4, state(0))
    assert cli(["verify", str(root)]) == 0
    capsys.readouterr()
    assert cli(["inspect", "--json", str(root)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 4 and doc["stats"]["writer"] == "tiersave.dcp"


def test_a_committed_step_is_never_overwritten(root: Path) -> None:
    save(root, 1, state(0))
    with pytest.raises(CheckpointException) as exc:
        save(root, 1, state(1))
    assert isinstance(failure(exc), AlreadyExistsError)
    assert_same(state(0), load(root, state(1)))
    # no attempt left behind (leases/ holds the load's read lease folder)
    assert sorted(p.name for p in root.iterdir() if p.name != "leases") == ["step-0000000001"]


def shard_of(root: Path, step: int) -> tuple[Path, dict[str, Any]]:
    step_dir = root / f"step-{step:010d}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    return step_dir / manifest["shards"][0]["file"], manifest


def test_a_flipped_byte_fails_the_load_with_a_typed_error(root: Path) -> None:
    save(root, 2, state(0))
    shard, manifest = shard_of(root, 2)
    entry = manifest["tensors"]["model.2.weight"]
    with shard.open("r+b") as f:
        f.seek(entry["offset"] + 17)
        byte = f.read(1)
        f.seek(entry["offset"] + 17)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointException) as exc:
        load(root, state(1))
    err = failure(exc)
    assert isinstance(err, CorruptCheckpointError)
    assert err.tensor == "model.2.weight" and err.step == 2 and "checksum mismatch" in str(err)
    assert cli(["verify", str(root)]) != 0


def test_a_truncated_shard_fails_the_load(root: Path) -> None:
    save(root, 2, state(0))
    shard, _ = shard_of(root, 2)
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 4096)
    with pytest.raises(CheckpointException) as exc:
        load(root, state(1))
    assert isinstance(failure(exc), CorruptCheckpointError)


def _tensor_item(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["tree"]["dcp"]["state"]["model.0.weight"]  # type: ignore[no-any-return]


def _bytes_item(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["tree"]["dcp"]["state"]["extra.epoch"]  # type: ignore[no-any-return]


HOSTILE = {
    "unknown dtype": lambda d: _tensor_item(d).update(dtype="float128"),
    "dtype mismatch with the stored chunk": lambda d: _tensor_item(d).update(dtype="float64"),
    "negative size": lambda d: _tensor_item(d).update(size=[-1, 40]),
    "chunk outside the tensor": lambda d: _tensor_item(d)["chunks"][0].update(offsets=[1, 0]),
    "missing chunk": lambda d: _tensor_item(d).update(size=[128, 40]),
    "too many dimensions": lambda d: _tensor_item(d).update(size=[1] * 65),
    "float size": lambda d: _tensor_item(d).update(size=[64.0, 40]),
    "unknown field": lambda d: _tensor_item(d).update(evil=1),
    "bad memory format": lambda d: _tensor_item(d).update(memory_format="os.system"),
    "bad kind": lambda d: _tensor_item(d).update(kind="pickle"),
    "bytes not uint8": lambda d: _bytes_item(d).update(data={"$tensor": "model.0.weight"}),
    "planner_data not a path": lambda d: d["tree"]["dcp"].update(planner_data={"a": [{"x": 1}]}),
    "storage_meta class name": lambda d: d["tree"]["dcp"].update(storage_meta={"__class__": "os.system"}),
    "not a DCP checkpoint": lambda d: d["tree"]["dcp"].update(encoding="other"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_metadata_is_rejected_before_use(root: Path, case: str) -> None:
    save(root, 5, state(0))
    path = root / "step-0000000005" / "manifest.json"
    doc = json.loads(path.read_text())
    HOSTILE[case](doc)
    path.write_bytes(seal(doc))  # resealed, as a forger would: the DCP validation must catch it
    with pytest.raises(FormatError) as exc:
        Reader(root)
    assert "step-0000000005" in str(exc.value)


@pytest.fixture
def with_custom(root: Path) -> Path:
    sd = state(0)
    sd["extra"]["custom"] = Custom(41)
    save(root, 6, sd)
    return root


def test_restricted_unpickler_refuses_unknown_classes(with_custom: Path) -> None:
    sd = state(1)
    sd["extra"]["custom"] = Custom(0)
    with pytest.raises(CheckpointException) as exc:
        load(with_custom, sd)
    err = failure(exc)
    assert isinstance(err, UnsupportedStateError) and err.path == "extra.custom"
    assert "unpickle='trusted'" in str(err)


def test_trusted_unpickling_loads_any_object(with_custom: Path) -> None:
    sd = state(1)
    sd["extra"]["custom"] = Custom(0)
    load(with_custom, sd, unpickle="trusted")
    assert sd["extra"]["custom"].value == 41


def test_never_unpickle_refuses_every_pickled_item(root: Path) -> None:
    save(root, 1, {"w": torch.ones(3), "n": 5})
    with pytest.raises(CheckpointException) as exc:
        load(root, {"w": torch.zeros(3), "n": 0}, unpickle="never")
    assert isinstance(failure(exc), UnsupportedStateError)
    sd = load(root, {"w": torch.zeros(3)}, unpickle="never")  # tensors only: fine
    assert torch.equal(sd["w"], torch.ones(3))


def test_newest_step_and_explicit_steps(root: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        Reader(root)
    save(root, 1, {"w": torch.full((3,), 1.0)})
    save(root, 20, {"w": torch.full((3,), 20.0)})
    assert Reader(root).step == 20
    assert torch.equal(load(root, {"w": torch.zeros(3)}, step=1)["w"], torch.full((3,), 1.0))
    with pytest.raises(CheckpointNotFoundError):
        Reader(root, step=2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"step": -1},
        {"step": 2**63},
        {"step": True},
        {"step": "3"},
        {"step": 1, "threads": 0},
        {"step": 1, "chunk_bytes": 1000},
        {"step": 1, "tags": "best"},
        {"step": 1, "tags": ["bad tag"]},
        {"step": 1, "metrics": {"loss": float("nan")}},
        {"step": 1, "metadata": {"x": object()}},
    ],
)
def test_writer_rejects_bad_arguments(root: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Writer(root, **kwargs)


def test_reader_rejects_bad_arguments(root: Path) -> None:
    save(root, 1, {"w": torch.ones(3)})
    with pytest.raises(ConfigError):
        Reader(root, unpickle="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Reader(root, step=-5)
    with pytest.raises(ConfigError):
        Reader(root, threads=1000)


def test_checkpoint_id_must_match_the_root(root: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="checkpoint_id"):
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "elsewhere"), storage_writer=Writer(root, step=1))
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(root), storage_writer=Writer(root, step=1))
    with pytest.raises(ConfigError, match="checkpoint_id"):
        dcp.load({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "elsewhere"), storage_reader=Reader(root))


def test_metrics_tags_and_metadata_reach_the_manifest(root: Path) -> None:
    save(root, 9, {"w": torch.ones(3)}, metrics={"loss": 0.5}, tags=["best"], metadata={"run": "a"})
    manifest = Reader(root).manifest
    assert manifest.metrics == {"loss": 0.5} and manifest.tags == ("best",) and manifest.metadata == {"run": "a"}


def test_export_writes_the_tensors_and_lists_the_pickled_items(root: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = state(0)
    save(root, 1, sd)
    dest = tmp_path / "all.safetensors"
    summary = export_safetensors(root, dest)
    assert "extra.epoch" in summary.pickled and "optim.param_groups.0.lr" in summary.pickled
    exported = load_file(dest)
    for name, value in sd["model"].items():
        assert torch.equal(exported[f"model.{name}"], value), name
    assert torch.equal(exported["extra.strided"], sd["extra"]["strided"])
    with pytest.raises(ConfigError, match="exists"):
        export_safetensors(root, dest)
    with pytest.raises(ConfigError, match="no tensor"):
        export_safetensors(root, tmp_path / "none.safetensors", prefix="nothing.")


class LosingWriter(Writer):
    """Simulates a root that is not shared: the coordinator cannot see a rank's shard at commit time."""

    def finish(self, metadata: Any, results: Any) -> None:
        for rank_results in results:
            for wr in rank_results:
                self.storage.delete(wr.storage_data.shard_key)
        super().finish(metadata, results)


def test_a_shard_the_coordinator_cannot_see_is_never_committed(root: Path) -> None:
    with pytest.raises(CheckpointException) as exc:
        dcp.save({"w": torch.ones(3)}, storage_writer=LosingWriter(root, step=1))
    err = failure(exc)
    assert isinstance(err, SaveError) and "not visible from the coordinator" in str(err)
    assert list(root.iterdir()) == []  # the attempt was removed, nothing committed


def test_an_empty_state_dict_round_trips(root: Path) -> None:
    save(root, 1, {})
    reader = Reader(root)
    assert reader.manifest.shards == () and reader.manifest.tensors == {}
    assert load(root, {}) == {}


@pytest.mark.s3
def test_a_writer_pickles_by_root_for_process_based_async_save(root: Path, s3_storage: Any) -> None:
    import pickle

    copy = pickle.loads(pickle.dumps(Writer(root, step=3)))  # what DCP's process executor does
    copy_state = {"w": torch.ones(2)}
    dcp.save(copy_state, storage_writer=copy)
    assert Reader(root).step == 3
    with pytest.raises(ConfigError, match="Storage object"):
        pickle.dumps(Writer(s3_storage, step=1))


def test_ranks_that_resolved_different_steps_fail_the_load(root: Path) -> None:
    from torch.distributed.checkpoint.planner import LoadPlan

    from tiersave.errors import DistributedCheckpointError

    save(root, 1, {"w": torch.ones(3)})
    old = Reader(root)
    save(root, 2, {"w": torch.ones(3)})
    new = Reader(root)
    plans = [old.prepare_local_plan(LoadPlan([])), new.prepare_local_plan(LoadPlan([]))]
    with pytest.raises(DistributedCheckpointError, match="rank 0: step 1, rank 1: step 2"):
        new.prepare_global_plan(plans)
    assert new.prepare_global_plan([plans[1], plans[1]]) == [plans[1], plans[1]]


def test_a_forged_shard_size_is_caught_before_allocating(root: Path) -> None:
    save(root, 1, {"w": torch.ones(3), "n": 4})
    path = root / "step-0000000001" / "manifest.json"
    doc = json.loads(path.read_text())
    huge = 1 << 36  # 64 GiB, more than this machine has
    doc["shards"][0]["size"] = huge
    doc["tensors"]["n"]["nbytes"] = huge - 8192
    doc["tensors"]["n"]["shape"] = [huge - 8192]
    doc["tensors"]["n"]["crc32c"] = ["00000000"] * -(-(huge - 8192) // doc["checksum"]["chunk_bytes"])
    path.write_bytes(seal(doc))  # resealed, as a forger would: the DCP validation must catch it
    with pytest.raises(CheckpointException) as exc:
        load(root, {"w": torch.zeros(3), "n": 0})
    assert isinstance(failure(exc), CorruptCheckpointError) and "the manifest says" in str(failure(exc))


def test_a_compressed_copy_loads_and_its_damage_is_caught(root: Path, tmp_path: Path) -> None:
    """A DCP checkpoint drained to a tier with compress="zstd" (format 3.0) loads through the Reader, each frame
    checked before it is decoded; a flipped stored byte is a typed error, not wrong tensors."""
    from tiersave.drain import copy_checkpoint

    saved = state(0)
    save(root, 6, saved, chunk_bytes=4096)  # several frames per shard
    dst = tmp_path / "zstd"
    copy_checkpoint(open_storage(str(root)), open_storage(str(dst)), 6, compress="zstd")
    shard, manifest = shard_of(dst, 6)
    assert manifest["format_version"].startswith("3.") and "encoding" in manifest["shards"][0]
    assert_same(saved, load(str(dst), state(1)))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x08
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as exc:
        load(str(dst), state(1))
    err = failure(exc)
    assert isinstance(err, CorruptCheckpointError) and err.step == 6 and "frame" in str(err)
