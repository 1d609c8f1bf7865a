"""S3Storage passes the storage conformance suite against a real SeaweedFS server."""

from __future__ import annotations

import pytest

from tiersave.storage.s3 import S3Storage
from tiersave.testing.conformance import StorageConformanceTests

pytestmark = pytest.mark.s3


class TestS3Storage(StorageConformanceTests):
    large_object_bytes = 12 << 20  # three 5 MiB parts (the fixture's part size): a real multipart upload

    @pytest.fixture
    def storage(self, s3_storage):
        return s3_storage

    def reopen(self, storage):
        opts = storage.options
        return S3Storage(opts)  # same options (credentials are not in the URI)
