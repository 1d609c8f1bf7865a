"""benchmarks/incremental_drain.py: a tiny run prints the table docs/benchmarks.md quotes ("Incremental
drains") with fewer bytes per incremental drain than per plain one, and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_tiny_run_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out_json = tmp_path / "drain.json"
    args = ["--base-mb", "32", "--adapter-mb", "2", "--saves", "3", "--reps", "1", "--dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(BENCH / "incremental_drain.py"), *args, "--json", str(out_json)],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(BENCH.parent / "src")),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| bytes written per drain |" in done.stdout and "| drain time |" in done.stdout
    summary = json.loads(out_json.read_text())["summary"]
    assert summary["incremental"]["bytes"] <= 0.2 * summary["plain"]["bytes"]
    assert summary["incremental"]["first_bytes"] == summary["plain"]["first_bytes"]  # the first drain is full
