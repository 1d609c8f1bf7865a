"""benchmarks/many_tensors.py, manifest_scale.py, vectored_reads.py and ranks_many_tensors.py: tiny runs print
the figures the docs quote (docs/benchmarks.md, issues 10 and 15) and write the plot, the JSON and the
profiles they are asked for."""

from __future__ import annotations

import json
import pstats
from pathlib import Path

import pytest

from helpers import run_benchmark


def _run(script: str, *args: str, cwd: Path) -> str:
    done = run_benchmark(script, *args, cwd=cwd)
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


def test_two_ranks_profile_their_restore_and_report_its_cpu(tmp_path: Path) -> None:
    prof, js = tmp_path / "prof", tmp_path / "out.json"
    prof.mkdir()
    common = ("--tensors-per-rank", "300", "--runs", "1", "--dir", str(tmp_path), "--timeout", "120")
    args = ("--ranks", "2", *common, "--profile-restore", str(prof), "--json", str(js))
    _run("ranks_many_tensors.py", *args, cwd=tmp_path)
    (summary,) = json.loads(js.read_text())
    assert summary["bit_exact"] and set(summary["restore_cpu_s"]) == {"0", "1"}
    assert all(cpu > 0 for cpu in summary["restore_cpu_s"].values())
    for rank in (0, 1):
        stats = pstats.Stats(str(prof / f"restore-2r-rank{rank}-run0.prof")).stats  # type: ignore[attr-defined]
        assert any(func == "restore_from" for _, _, func in stats)


def test_parse_mode_times_the_whole_parse_and_the_view(tmp_path: Path) -> None:
    js = tmp_path / "parse.json"
    args = ("--rank0-cpu", "--parse-cpu", "--ranks", "2", "4", "--tensors-per-rank", "300", "--runs", "1")
    _run("ranks_many_tensors.py", *args, "--dir", str(tmp_path), "--json", str(js), cwd=tmp_path)
    rows = json.loads(js.read_text())
    assert [r["ranks"] for r in rows] == [2, 4]
    assert all(r["parse_whole_cpu_s"] > 0 and r["parse_view_cpu_s"] > 0 for r in rows)
