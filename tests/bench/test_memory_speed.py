"""benchmarks/memory_speed.py: a tiny run prints every row and target of issue 16's memory-speed table, and
``--update-docs`` replaces exactly the marked section of a document (docs/benchmarks.md is regenerated so)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_speed.py"


def test_tiny_run_prints_every_row_and_updates_only_the_marked_section(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("before\n<!-- memory-speed:begin -->\nold table\n<!-- memory-speed:end -->\nafter\n")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src"), "TIERSAVE_SHM_DIR": str(tmp_path / "shm")}
    args = ["--dir", str(tmp_path), "--state-mb", "4", "--reps", "3", "--update-docs", str(doc)]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env, check=True
    ).stdout
    for row in ("memcpy", "restore mem:// into live", "save_async into mem:// (blocked)",
                "DLRover-like shared-memory copy", "io=buffered save (durable)", "plain buffered write + fsync"):  # fmt: skip
        assert f"| {row} |" in out, out
    assert out.count("| met |") + out.count("| **missed** |") == 4, out
    text = doc.read_text()
    assert text.startswith("before\n<!-- memory-speed:begin -->\nstate ") and text.endswith(
        "<!-- memory-speed:end -->\nafter\n"
    )
    assert "old table" not in text and "| restore mem:// into live |" in text
    assert not list((tmp_path / "shm").iterdir())  # the memory-tier namespace is destroyed


def test_fewer_than_three_reps_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dir", str(tmp_path), "--reps", "2"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "at least 3" in proc.stderr
