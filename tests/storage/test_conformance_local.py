"""LocalStorage passes the storage conformance suite (on the work disk, ext4)."""

from __future__ import annotations

import pytest

from tiersave.storage.posix import LocalStorage
from tiersave.testing.conformance import StorageConformanceTests


class TestLocalStorage(StorageConformanceTests):
    @pytest.fixture
    def storage(self, tmp_path):
        storage = LocalStorage(tmp_path / "root")
        yield storage
        storage.close()
