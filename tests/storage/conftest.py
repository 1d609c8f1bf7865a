"""Fixtures for the storage tests: the real SeaweedFS S3 server (one per session) and per-test buckets.

The S3 tests never skip: if SeaweedFS's ``weed`` is missing, the ``seaweed`` fixture fails with the
command that installs it.
"""

from __future__ import annotations

import uuid
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
