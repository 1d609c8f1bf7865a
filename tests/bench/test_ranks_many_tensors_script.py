"""benchmarks/ranks_many_tensors.py: a tiny run of two real ranks profiles each rank's restore and reports its
CPU; the parse mode times a rank's parse of the global manifest whole and as its view (docs/benchmarks.md,
"The restore at many ranks x many tensors")."""

from __future__ import annotations

import json
import os
import pstats
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(*args: str, cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent / "src"))
    done = subprocess.run(
        [sys.executable, str(BENCH / "ranks_many_tensors.py"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_two_ranks_profile_their_restore_and_report_its_cpu(tmp_path: Path) -> None:
    prof, js = tmp_path / "prof", tmp_path / "out.json"
    prof.mkdir()
    common = ("--tensors-per-rank", "300", "--runs", "1", "--dir", str(tmp_path), "--timeout", "120")
    _run("--ranks", "2", *common, "--profile-restore", str(prof), "--json", str(js), cwd=tmp_path)
    (summary,) = json.loads(js.read_text())
    assert summary["bit_exact"] and set(summary["restore_cpu_s"]) == {"0", "1"}
    assert all(cpu > 0 for cpu in summary["restore_cpu_s"].values())
    for rank in (0, 1):
        stats = pstats.Stats(str(prof / f"restore-2r-rank{rank}-run0.prof")).stats  # type: ignore[attr-defined]
        assert any(func == "restore_from" for _, _, func in stats)


def test_parse_mode_times_the_whole_parse_and_the_view(tmp_path: Path) -> None:
    js = tmp_path / "parse.json"
    args = ("--rank0-cpu", "--parse-cpu", "--ranks", "2", "4", "--tensors-per-rank", "300", "--runs", "1")
    _run(*args, "--dir", str(tmp_path), "--json", str(js), cwd=tmp_path)
    rows = json.loads(js.read_text())
    assert [r["ranks"] for r in rows] == [2, 4]
    assert all(r["parse_whole_cpu_s"] > 0 and r["parse_view_cpu_s"] > 0 for r in rows)
