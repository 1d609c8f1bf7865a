"""Fixtures for the storage tests: the real SeaweedFS S3 server (one per session) and per-test buckets.

The S3 tests never skip: if SeaweedFS's ``weed`` is missing, the ``seaweed`` fixture fails with the
command that installs it.
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from helpers import S3_TEST_OPTIONS
from tiersave.storage.s3 import S3Storage
from tiersave.testing.seaweed import SeaweedServer


@pytest.fixture(scope="session")
def seaweed() -> SeaweedServer:
    """The session's SeaweedFS server (started on first use, killed at exit)."""
    return SeaweedServer.shared()


def new_bucket() -> str:
    return f"ts-{uuid.uuid4().hex[:20]}"


@pytest.fixture
def s3_bucket(seaweed: SeaweedServer) -> str:
    """A fresh, empty bucket name on the session server (created on first use)."""
    return new_bucket()


@pytest.fixture
def s3_storage(seaweed: SeaweedServer, s3_bucket: str) -> Any:
    storage: S3Storage = seaweed.storage(s3_bucket, "root/prefix", **S3_TEST_OPTIONS)
    yield storage
    storage.close()


# pytest imports each conftest.py outside a package as the module "conftest", so this file replaces
# tests/conftest.py in sys.modules, and test modules collected after this directory that do
# `from conftest import assert_same` would find this one. Forward those helper names to tests/conftest.py.
_TOP: ModuleType | None = None


def _top() -> ModuleType:
    global _TOP
    if _TOP is None:
        path = Path(__file__).resolve().parents[1] / "conftest.py"
        spec = importlib.util.spec_from_file_location("_tiersave_tests_conftest", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _TOP = module
    return _TOP


def __getattr__(name: str) -> Any:
    if name.startswith(("_", "pytest", "collect_")):
        raise AttributeError(name)
    return getattr(_top(), name)
