"""benchmarks/save_vs_raw.py: a tiny run alternates the raw direct write and each thread count of tiersave's save,
prints the medians docs/benchmarks.md quotes, and leaves no checkpoint behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_benchmark


def test_tiny_run_times_every_method_each_round(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    d = tmp_path / "d"
    done = run_benchmark(
        "save_vs_raw.py", "--dir", str(d), "--gb", "0.02", "--rounds", "2", "--threads", "1,2", "--pause", "0",
        "--json", str(out),
    )  # fmt: skip
    if done.returncode != 0 and "refuses O_DIRECT" in done.stderr:
        pytest.skip("the test directory's file system refuses O_DIRECT")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["gbps"]) == {"raw", "tiersave x1", "tiersave x2"}
    assert all(len(v) == 2 and min(v) > 0 for v in data["gbps"].values())
    for name in ("tiersave x1", "tiersave x2"):  # each round's save over the same round's raw write
        ratios = sorted(v / r for v, r in zip(data["gbps"][name], data["gbps"]["raw"], strict=True))
        assert data["summary"][name]["median_vs_raw"] == pytest.approx((ratios[0] + ratios[1]) / 2)
    assert "tiersave x2    median" in done.stdout and "/raw" in done.stdout
    assert sorted(p.name for p in d.iterdir()) == []  # the raw file and both checkpoints' roots are gone


def test_refuses_a_directory_with_files(tmp_path: Path) -> None:
    (tmp_path / "t1").mkdir()  # a name the run would write and remove
    done = run_benchmark("save_vs_raw.py", "--dir", str(tmp_path), "--gb", "0.01", timeout=60)
    assert done.returncode == 2 and "give a new or empty directory" in done.stderr
    assert (tmp_path / "t1").is_dir()
