"""Shared fixtures and helpers. Tests run on the ext4 work disk (pytest's tmp_path), never on mocks of
the file system; fault injection uses small wrappers around the real storage."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

# Test modules import shared helpers with `from helpers import ...` (tests/helpers.py). Helpers do not
# live here: pytest imports every conftest.py as the module "conftest", so `from conftest import x`
# would depend on which directory's conftest was imported last.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An empty checkpoint root on the work disk."""
    path = tmp_path / "ckpt"
    path.mkdir()
    return path


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """A random seed, printed so a failure can be replayed with TIERSAVE_TEST_SEED."""
    value = int(os.environ.get("TIERSAVE_TEST_SEED", random.randrange(1 << 30)))
    print(f"\n[{request.node.name}] seed={value} (replay: TIERSAVE_TEST_SEED={value})")
    return value
