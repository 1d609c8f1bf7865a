"""benchmarks/restore_fresh.py: a tiny run times every method in processes of their own and measures the memory
each timed call made resident (the reads into new memory and the restore into new tensors the whole state, the
read into one buffer and the restore into a live state little of it), then removes its directory; it refuses a
directory it would have to delete others' files from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import assert_refuses_a_busy_dir, run_benchmark


def test_tiny_run_measures_every_method_in_fresh_processes(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    d = tmp_path / "d"
    done = run_benchmark(
        "restore_fresh.py", "--dir", str(d), "--gb", "0.2", "--rounds", "2", "--json", str(out), timeout=300
    )
    if done.returncode != 0 and "refuses O_DIRECT" in done.stderr:
        pytest.skip("the test directory's file system refuses O_DIRECT")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    methods = ("raw, one buffer", "raw, new memory x1", "raw, new memory x4", "restore new", "restore into")
    assert set(data["gbps"]) == set(methods)
    assert all(len(v) == 2 and min(v) > 0 for v in data["gbps"].values())
    state = data["bytes"]
    grown = data["resident_growth"]
    for m in ("raw, new memory x1", "raw, new memory x4", "restore new"):  # the whole state lands in new memory
        assert min(grown[m]) >= 0.9 * state, m
    assert max(grown["raw, one buffer"]) < 0.05 * state  # its one buffer was written before the clock
    assert max(grown["restore into"]) < 0.5 * state  # the live state was resident before the clock
    assert data["settings"]["rounds"] == 2 and "UTC, load" in done.stdout.splitlines()[0]
    assert "restore into         median" in done.stdout
    assert not d.exists()


def test_refuses_a_directory_with_files_and_results_inside_the_directory(tmp_path: Path) -> None:
    assert_refuses_a_busy_dir("restore_fresh.py", tmp_path, "--gb", "0.01")
