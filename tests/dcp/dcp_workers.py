"""Code that runs inside the ranks started by ``dcp_harness.run_ranks`` (and one helper process)."""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from tiersave.dcp import Reader, Writer
from tiersave.errors import NoSpaceError

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build(seed: int) -> nn.Module:
    """Uneven first dimensions (30, 7) so that 4 and 2 ranks get shards of different sizes; rows of 1200
    bytes so that with 4 KiB checksum chunks a rank's region starts and ends inside chunks."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(300, 30), nn.ReLU(), nn.Linear(30, 7))


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One optimizer step with element-wise gradients, so every rank count computes the same values."""
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 0.25
    opt.step()


def fsdp(seed: int, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = build(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step(model, opt)
    return model, opt


def flat_full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, unsharded, under flat names (collective)."""
    msd, osd = get_state_dict(model, opt, options=FULL)
    out = {f"model.{k}": v for k, v in msd.items()}
    for fqn, state in osd.get("state", {}).items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{fqn}.{key}"] = value
    return out


class FailingWriter(Writer):
    """A writer whose ``write_data`` fails on one rank, as a full disk would."""

    def __init__(self, *args: Any, fail_rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_rank = fail_rank

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self._rank == self.fail_rank:
            raise NoSpaceError(f"injected: rank {self._rank} ran out of space", tier=self.storage.uri)
        return super().write_data(plan, planner)


def save_fsdp(rank: int, world_size: int, root: str, ref_path: str) -> None:
    """Step 1 with dcp.save, step 2 with dcp.async_save, step 3 fails on rank 2 and must stay invisible."""
    model, opt = fsdp(0, world_size)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"epoch": 3, "ids": torch.arange(10), "name": "run-a"}}
    dcp.save(state, storage_writer=Writer(root, step=1, threads=2, chunk_bytes=4096))
    fut = dcp.async_save(state, storage_writer=Writer(root, step=2, threads=2))
    fut.result(timeout=60)  # type: ignore[union-attr]

    failing = FailingWriter(root, step=3, fail_rank=2)
    failures: dict[int, Any] = {}
    try:
        dcp.save(state, storage_writer=failing)
    except CheckpointException as exc:
        failures = exc.failures
    assert set(failures) == {2}, f"every rank must see rank 2's failure, got {failures}"
    assert isinstance(failures[2][0], NoSpaceError), failures
    failing.abort()  # coordinator: remove the attempt now (a no-op on the other ranks)

    full = flat_full(model, opt)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in full.items()}, ref_path)
        names = sorted(os.listdir(root))
        assert names == ["step-0000000001", "step-0000000002"], names


def load_fsdp(rank: int, world_size: int, root: str, ref_path: str, steps: list[int]) -> None:
    for step_ in steps:
        _load_fsdp(rank, world_size, root, ref_path, step_)


def _load_fsdp(rank: int, world_size: int, root: str, ref_path: str, step_: int) -> None:
    model, opt = fsdp(1 + step_, world_size)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"epoch": 0, "ids": torch.zeros(10, dtype=torch.int64), "name": ""}}
    dcp.load(state, storage_reader=Reader(root, step=step_, threads=2))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = state["extra"]
    assert extra["epoch"] == 3 and extra["name"] == "run-a" and torch.equal(extra["ids"], torch.arange(10)), extra
    full = flat_full(model, opt)
    if rank == 0:
        assert_matches_reference(full, ref_path)


def assert_matches_reference(full: dict[str, torch.Tensor], ref_path: str) -> None:
    from safetensors.torch import load_file

    ref = load_file(ref_path)
    assert sorted(full) == sorted(ref), (sorted(full), sorted(ref))
    for name, value in ref.items():
        got = full[name]
        assert got.dtype == value.dtype and torch.equal(got, value), f"{name} differs after resharding"


def save_then_die(root: str) -> None:
    """A single-process save killed (SIGKILL) after every shard is durable, just before the commit."""

    class Dying(Writer):
        def finish(self, metadata: Any, results: Any) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

    warnings.simplefilter("ignore")
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    dcp.save(state, storage_writer=Dying(root, step=7))


def process_async_save(rank: int, world_size: int, root: str) -> None:
    """dcp.async_save with DCP's process-based executor: the writer is pickled into a background process."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = {"w": torch.arange(1000, dtype=torch.float32) + rank, "n": 3}
    fut = dcp.async_save(
        state, storage_writer=Writer(root, step=5), async_checkpointer_type=AsyncCheckpointerType.PROCESS
    )
    fut.result(timeout=120)  # type: ignore[union-attr]
    out = {"w": torch.zeros(1000), "n": 0}
    dcp.load(out, storage_reader=Reader(root, step=5))
    assert out["n"] == 3 and torch.equal(out["w"], state["w"]), out
