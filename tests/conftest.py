"""Shared fixtures and helpers. Tests run on the ext4 work disk (pytest's tmp_path), never on mocks of
the file system; fault injection uses small wrappers around the real storage."""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Test modules import shared helpers with `from helpers import ...` (tests/helpers.py). Helpers do not
# live here: pytest imports every conftest.py as the module "conftest", so `from conftest import x`
# would depend on which directory's conftest was imported last.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session", autouse=True)
def private_memory_tier() -> Iterator[None]:
    """The run's ``mem://`` roots live in a directory of their own on the real tmpfs, removed at the end.

    The memory tier outlives its process by design (a crashed job restores from it), so every root a test
    creates would otherwise stay in the user's ``/dev/shm/tiersave-<uid>`` (2.9 GB of them piled up here
    over a day of runs). Set in the environment, so the tests' worker processes inherit it; a test that
    points ``TIERSAVE_SHM_DIR`` elsewhere still can (monkeypatch restores this one after it)."""
    if os.environ.get("TIERSAVE_SHM_DIR"):
        yield
        return
    path = tempfile.mkdtemp(prefix="tiersave-tests-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.environ["TIERSAVE_SHM_DIR"] = path
    try:
        yield
    finally:
        os.environ.pop("TIERSAVE_SHM_DIR", None)
        shutil.rmtree(path, ignore_errors=True)


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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="run the long variants of the reliability figures (many more crash trials and fuzz examples)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: a long variant, run only with --long (skipped by default)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="a long variant: run with --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def long_run(request: pytest.FixtureRequest) -> bool:
    """True under ``--long``: a figures test scales its trial or example count up."""
    return bool(request.config.getoption("--long"))


@pytest.fixture
def ext4_dir(tmp_path: Path) -> Path:
    """tmp_path, where it is on a block-device file system that accepts O_DIRECT (else the test is skipped)."""
    from tiersave.storage.posix import filesystem_type
    from tiersave.storage.posix.directio import probe_direct_io

    if filesystem_type(tmp_path) in ("tmpfs", "ramfs", ""):
        pytest.skip("needs a block-device file system for O_DIRECT alignment rules")
    if not probe_direct_io(tmp_path):
        pytest.skip("O_DIRECT refused here")
    return tmp_path
