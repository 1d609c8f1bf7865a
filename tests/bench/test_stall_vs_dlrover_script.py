"""benchmarks/stall_vs_dlrover.py: a tiny run pairs tiersave's save_async stall with DLRover's copy each round,
prints the ratio docs/benchmarks.md quotes, and leaves nothing behind."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from helpers import assert_refuses_a_busy_dir, run_benchmark
from tiersave.engine.memcopy import large_copy, stream_available


def test_tiny_run_pairs_the_stalls_every_round(tmp_path: Path) -> None:
    """With ``--memmove-too`` (where the streaming copy was built) a third contender, save_async staging with
    memmove, is timed in the same rounds."""
    three = stream_available()
    out, d = tmp_path / "run.json", tmp_path / "d"
    done = run_benchmark(
        "stall_vs_dlrover.py", "--dir", str(d), "--gb", "0.02", "--rounds", "3", "--no-drop-caches",
        *(["--memmove-too"] if three else []), "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["rounds"]) == 3
    for r in data["rounds"]:
        assert 0 < r["tiersave_stage"] <= r["tiersave"] and r["dlrover"] > 0, r
        assert not three or 0 < r["memmove_stage"] <= r["memmove"], r
    ratios = [r["dlrover"] / r["tiersave"] for r in data["rounds"]]
    assert data["dlrover_over_tiersave"] == pytest.approx(statistics.median(ratios))
    assert "dlrover/tiersave, median of the rounds" in done.stdout
    if three:
        assert "memmove/tiersave, median of the rounds" in done.stdout
        assert data["stage_copy"] == {"tiersave": large_copy()[1], "memmove": "memmove"}
        gains = [r["memmove"] / r["tiersave"] for r in data["rounds"]]
        assert data["memmove_over_tiersave"] == pytest.approx(statistics.median(gains))
    else:
        assert data["stage_copy"] == {"tiersave": "memmove"}
    assert not d.exists()


def test_refuses_a_directory_with_files_and_results_inside_the_directory(tmp_path: Path) -> None:
    assert_refuses_a_busy_dir("stall_vs_dlrover.py", tmp_path, "--gb", "0.01")
