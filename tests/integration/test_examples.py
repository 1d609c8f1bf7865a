"""The trainer examples run end to end at smoke size, as a user would run them: a first run stops early, a
second run of the same command resumes from the newest checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run(script: str, *args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, env=env, timeout=150
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.timeout(300)
def test_hf_trainer_example_stops_then_resumes(tmp_path):
    pytest.importorskip("transformers")
    first = run("hf_trainer.py", "--dir", str(tmp_path), "--epochs", "1", "--stop-at", "10")
    assert "stopped at step 10" in first
    second = run("hf_trainer.py", "--dir", str(tmp_path), "--epochs", "1")
    assert "resuming from step 10" in second and "stopped at step 20" in second


@pytest.mark.timeout(300)
def test_lightning_example_stops_then_resumes(tmp_path):
    pytest.importorskip("lightning")
    first = run("lightning_fit.py", "--dir", str(tmp_path), "--epochs", "1")
    assert "epoch 1, step 16" in first
    second = run("lightning_fit.py", "--dir", str(tmp_path), "--epochs", "2")
    assert "epoch 2, step 32" in second
    # Stored: exactly the steps the .ckpt pointers name (Lightning keeps the last.ckpt it resumed from and
    # writes last-v1.ckpt; the old best pointer was rotated out).
    named = {json.loads(p.read_text())["step"] for p in (tmp_path / "ckpt").glob("*.ckpt")}
    stored = {int(s) for s in second.rsplit("stored steps: ", 1)[1].split(",")}
    assert stored == named and 32 in named
