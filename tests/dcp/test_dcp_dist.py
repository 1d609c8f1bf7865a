"""DCP on tiersave with real ranks: FSDP2 (fully_shard) on CPU gloo saved on 4 ranks, loaded on 2 and 1.

The 4-rank job saves step 1 with ``dcp.save``, step 2 with ``dcp.async_save``, and a step 3 that fails
on rank 2 (which must stay invisible). The loads compare every model and optimizer tensor, unsharded,
bit for bit with what the saving job gathered.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import dcp_workers  # tests/dcp is on sys.path (pytest's prepend import mode), so the ranks find it too
import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_harness import _context, run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tiersave.dcp import Reader, export_safetensors
from tiersave.errors import CheckpointNotFoundError

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("dcp4")
    root, ref = base / "root", base / "ref.safetensors"
    run_ranks("dcp_workers.save_fsdp", 4, str(root), str(ref), outdir=base / "reports", timeout_s=150)
    return root, ref


def test_fsdp_saved_on_4_ranks_is_one_committed_checkpoint_per_step(saved: tuple[Path, Path]) -> None:
    root, _ = saved
    assert sorted(os.listdir(root)) == ["step-0000000001", "step-0000000002"]  # failed step 3 left nothing
    reader = Reader(root, step=1)
    assert reader.manifest.world_size == 4
    assert sorted(s.rank for s in reader.manifest.shards) == [0, 1, 2, 3]
    assert Reader(root).step == 2


def test_fsdp_load_on_2_ranks_is_bit_exact(saved: tuple[Path, Path], tmp_path: Path) -> None:
    """Both the step written by dcp.save and the one written by dcp.async_save."""
    root, ref = saved
    run_ranks("dcp_workers.load_fsdp", 2, str(root), str(ref), [1, 2], outdir=tmp_path / "reports", timeout_s=120)


def test_fsdp_load_on_1_process_is_bit_exact(saved: tuple[Path, Path]) -> None:
    root, ref = saved
    model = dcp_workers.build(seed=2)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    dcp_workers.step(model, opt)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": {"epoch": 0, "ids": torch.zeros(10, dtype=torch.int64), "name": ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        dcp.load(state, storage_reader=Reader(root, step=1))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["extra"]["epoch"] == 3
    assert opt.param_groups[0]["lr"] == 0.01  # a pickled item, through the restricted unpickler
    dcp_workers.assert_matches_reference(dcp_workers.flat_full(model, opt), str(ref))


def test_export_consolidates_the_4_rank_shards_into_whole_tensors(saved: tuple[Path, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    root, ref = saved
    summary = export_safetensors(root, tmp_path / "model.safetensors", step=1, prefix="model.")
    assert summary.step == 1 and summary.tensors == 4 and not summary.pickled
    exported = load_file(tmp_path / "model.safetensors")
    reference = {k.removeprefix("model."): v for k, v in load_file(ref).items() if k.startswith("model.")}
    assert sorted(exported) == sorted(reference) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name, value in reference.items():
        assert torch.equal(exported[name], value), name


def test_the_export_command_consolidates_a_dcp_checkpoint(saved: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file

    from tiersave.cli import main

    root, ref = saved
    dest = tmp_path / "cli.safetensors"
    assert main(["export", str(root), "--step", "1", "--prefix", "model.", "--to", str(dest), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tensors"] == 4 and doc["step"] == 1
    exported = load_file(dest)
    reference = {k.removeprefix("model."): v for k, v in load_file(ref).items() if k.startswith("model.")}
    assert sorted(exported) == sorted(reference)
    assert all(torch.equal(exported[k], v) for k, v in reference.items())


def test_save_killed_before_finish_leaves_nothing_visible(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = _context().Process(target=dcp_workers.save_then_die, args=(str(root),), daemon=True)
    proc.start()
    proc.join(90)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        pytest.fail("the saving process did not reach its commit within 90 s")
    assert proc.exitcode == -9
    leftovers = os.listdir(root)
    assert len(leftovers) == 1 and leftovers[0].startswith("step-0000000007.tmp-"), leftovers
    assert (root / leftovers[0] / "shard-00000-000.bin").stat().st_size == 4096  # the data was written
    with pytest.raises(CheckpointNotFoundError):
        Reader(root)
    with pytest.raises(CheckpointNotFoundError):
        Reader(root, step=7)
    from tiersave.cli import main

    assert main(["prune", str(root)]) == 0  # the dead save's directory goes
    assert os.listdir(root) == []


def test_process_based_async_save(tmp_path: Path) -> None:
    root = tmp_path / "root"
    run_ranks("dcp_workers.process_async_save", 1, str(root), outdir=tmp_path / "reports", timeout_s=120)
    assert Reader(root).step == 5
