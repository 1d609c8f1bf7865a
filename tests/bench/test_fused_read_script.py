"""benchmarks/fused_read.py: a tiny run restores bit-exact on both read paths and prints its table (the
figures of "The restore's copy and checksum in one pass" in docs/benchmarks.md come from it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fused_read.py"


def test_a_tiny_run_prints_both_paths(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SCRIPT.parents[1] / "src"))
    args = ["--dir", str(tmp_path), "--size", "0.02", "--reps", "1", "--no-drop-caches"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| into") or line.startswith("| new")]
    assert [row.split(" | ")[1] for row in rows] == ["fused", "separate", "fused", "separate"], proc.stdout
