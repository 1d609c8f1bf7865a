"""benchmarks/gpu_stall.py, issue 16's GPU figures in one command: a tiny run on host tensors (``--device
cpu``) times every method, restores what each saved (the script fails if a restore differs) and prints its
tables, so the command is known to work before a GPU machine runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_benchmark


def test_a_tiny_cpu_run_times_every_method_and_restores_what_it_saved(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    args = ["--dir", str(tmp_path / "ckpt"), "--gb", "0.02", "--reps", "1", "--device", "cpu", "--no-drop-caches"]
    proc = run_benchmark("gpu_stall.py", *args, "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["saves"]) == {
        "d2h copy (floor)",
        "tiersave save_async",
        "tiersave lazy",
        "optimizer step alone",
        "dcp async_save (pinned)",
    }
    assert set(result["restores"]) == {"h2d copy (floor)", "tiersave restore into", "dcp load into"}
    assert result["machine"]["device"] == "cpu" and result["state_bytes"] > 10_000_000
    eager = result["saves"]["tiersave save_async"]
    assert 0 < eager["blocked"]["median"] <= eager["durable"]["median"]
    assert "tiersave lazy held / dcp async_save held" in proc.stdout


def test_without_a_gpu_the_default_device_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the default runs")
    proc = run_benchmark("gpu_stall.py", "--dir", str(tmp_path), "--gb", "0.01", timeout=120)
    assert proc.returncode != 0 and "no CUDA device here" in proc.stderr


def test_a_tiny_cuda_run_restores_what_it_saved(tmp_path: Path) -> None:
    """Where a GPU exists: the same tiny run on CUDA tensors (pinned buffers, side streams, DCP's pinned stager)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    args = ["--dir", str(tmp_path / "ckpt"), "--gb", "0.05", "--reps", "1", "--no-drop-caches"]
    proc = run_benchmark("gpu_stall.py", *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tiersave save_async held / dcp async_save held" in proc.stdout
