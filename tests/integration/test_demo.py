"""The README's main job, scaled down: `tiersave demo` kills training with SIGKILL and resumes bit-exact."""

from __future__ import annotations

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
    assert "restored step 30" in out.stdout
    assert "equal the reference run bit for bit (30/30), final weights identical" in out.stdout
    steps = listing(tmp_path / "checkpoints")
    assert steps == ["step-0000000040", "step-0000000050", "step-0000000060"]  # keep-last 3
