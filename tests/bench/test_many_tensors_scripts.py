"""benchmarks/many_tensors.py, manifest_scale.py and vectored_reads.py: tiny runs print the figures the docs
quote (docs/benchmarks.md, issue 15) and write the plot and the JSON they are asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str, cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent / "src"))
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_restore_only_compares_moe_with_few_large_new_and_live(tmp_path: Path) -> None:
    out = _run(
        "many_tensors.py",
        *("--counts", "--moe-mb", "16", "--expert-mib", "2", "--runs", "1", "--restore-only", "--dir", str(tmp_path)),
        cwd=tmp_path,
    )
    assert "moe-2MiB: restore" in out and "into a live state" in out
    assert "MoE-like vs few large: restore" in out


def test_scaling_plot_and_json(tmp_path: Path) -> None:
    png, js = tmp_path / "scaling.png", tmp_path / "scaling.json"
    out = _run(
        "many_tensors.py",
        *("--counts", "50", "200", "--moe-mb", "0", "--runs", "1", "--dir", str(tmp_path)),
        *("--plot", str(png), "--json", str(js)),
        cwd=tmp_path,
    )
    assert "per tensor (us): 50:" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = json.loads(js.read_text())
    assert {v["tensors"] for v in samples.values()} == {50, 200}


@pytest.mark.parametrize(("encoding", "low", "high"), [("entries", 150, 400), ("compact", 20, 100)])
def test_manifest_scale_reports_size_parse_and_the_cap(tmp_path: Path, encoding: str, low: int, high: int) -> None:
    js = tmp_path / "m.json"
    args = ("--counts", "1000", "--runs", "1", "--encoding", encoding, "--json", str(js))
    out = _run("manifest_scale.py", *args, cwd=tmp_path)
    assert "1,000 tensors" in out and "the 64 MiB cap holds about" in out
    (row,) = json.loads(js.read_text())
    assert row["tensors"] == 1000 and low < row["bytes_per_tensor"] < high and not row["over_cap"]


def test_vectored_reads_prints_every_method(tmp_path: Path) -> None:
    out = _run("vectored_reads.py", "--mib", "64", "--runs", "1", "--dir", str(tmp_path), cwd=tmp_path)
    for method in ("4MiB:", "64MiB:", "4MiBx16:"):
        assert method in out
    assert not list(tmp_path.iterdir())  # its data file is removed


def test_dcp_many_tensors_times_the_three_paths_and_writes_its_json(tmp_path: Path) -> None:
    out = _run(
        "dcp_many_tensors.py",
        *("--dir", str(tmp_path / "d"), "--counts", "50", "--runs", "1", "--json", str(tmp_path / "r.json")),
        cwd=tmp_path,
    )
    for name in ("tiersave", "dcp+tiersave", "dcp"):
        assert f"     50 x 1 KiB  {name:<13} save" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    row = doc["results"]["50"]
    assert set(row) == {"tiersave", "dcp+tiersave", "dcp"}
    assert all(r["save_ms"] > 0 and r["load_ms"] > 0 for r in row.values())
    assert not (tmp_path / "d" / "n50").exists()  # each count's checkpoints are removed after it
