"""benchmarks/restore_fresh.py: a tiny run times every method in processes of their own, counts the pages each
faults in (the reads into new memory fault in the whole file, the read into one buffer none), and removes its
directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_benchmark


def test_tiny_run_measures_every_method_in_fresh_processes(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    d = tmp_path / "d"
    done = run_benchmark(
        "restore_fresh.py", "--dir", str(d), "--gb", "0.03", "--rounds", "2", "--json", str(out), timeout=300
    )
    if done.returncode != 0 and "refuses O_DIRECT" in done.stderr:
        pytest.skip("the test directory's file system refuses O_DIRECT")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    methods = ("raw, one buffer", "raw, new memory x1", "raw, new memory x4", "restore new", "restore into")
    assert set(data["gbps"]) == set(methods)
    assert all(len(v) == 2 and min(v) > 0 for v in data["gbps"].values())
    pages = data["bytes"] // 4096
    for m in ("raw, new memory x1", "raw, new memory x4", "restore new"):  # every page of the state, new
        assert min(data["faults"][m]) >= 0.9 * pages, m
    assert max(data["faults"]["raw, one buffer"]) < 0.1 * pages  # its buffer was faulted in before the clock
    assert "restore into         median" in done.stdout
    assert not d.exists()
