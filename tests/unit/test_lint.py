"""The code stays lint-clean and strictly typed: ruff (rules in pyproject.toml) and mypy --strict over src/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run ./scripts/setup.sh")
    return found


@pytest.mark.parametrize(
    "args",
    [["check", "src", "tests", "benchmarks"], ["format", "--check", "src", "tests", "benchmarks"]],
    ids=["lint", "format"],
)
def test_ruff(args):
    result = subprocess.run([_tool("ruff"), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict():
    result = subprocess.run([_tool("mypy"), "--no-incremental"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
