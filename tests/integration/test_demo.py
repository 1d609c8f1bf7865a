"""The README's main job, scaled down: `tiersave demo` kills training with SIGKILL and resumes bit-exact."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import listing


@pytest.mark.slow
def test_demo_resumes_bit_exact_after_sigkill(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiersave.cli",
            "demo",
            "--steps",
            "60",
            "--save-every",
            "10",
            "--kill-at",
            "37",
            "--keep-last",
            "3",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "killed at step 37" in out.stdout
    # the kill does not wait for step 30's save: on a slow disk its commit may come too late, and the newest
    # committed checkpoint (20) is the one to resume from
    committed = [int(s) for s in re.search(r"committed checkpoints: ([0-9, ]+)", out.stdout).group(1).split(", ")]
    assert committed[-1] in (20, 30) and committed == list(range(10, committed[-1] + 1, 10)), out.stdout
    resumed = 60 - committed[-1]
    assert f"restored step {committed[-1]}" in out.stdout
    assert f"equal the reference run bit for bit ({resumed}/{resumed}), final weights identical" in out.stdout
    steps = listing(tmp_path / "checkpoints")
    assert steps == ["step-0000000040", "step-0000000050", "step-0000000060"]  # keep-last 3
