"""Fixtures of the DCP tests: the session's SeaweedFS S3 server (the one the storage tests use)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from helpers import S3_TEST_OPTIONS
from tiersave.testing.seaweed import SeaweedServer


@pytest.fixture(scope="session")
def seaweed() -> SeaweedServer:
    return SeaweedServer.shared()


@pytest.fixture
def s3_storage(seaweed: SeaweedServer) -> Any:
    storage = seaweed.storage(f"ts-{uuid.uuid4().hex[:20]}", "dcp/root", **S3_TEST_OPTIONS)
    yield storage
    storage.close()
