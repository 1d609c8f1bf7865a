"""MemoryStorage (mem://, /dev/shm) passes the storage conformance suite and cleans up after itself."""

from __future__ import annotations

import uuid

import pytest

from tiersave.storage import open_storage
from tiersave.storage.memory import MemoryStorage, namespaces
from tiersave.testing.conformance import StorageConformanceTests


class TestMemoryStorage(StorageConformanceTests):
    @pytest.fixture
    def storage(self):
        storage = MemoryStorage(f"conformance-{uuid.uuid4().hex[:12]}")
        yield storage
        storage.destroy()
        assert storage.uri not in [n.uri for n in namespaces()]


def test_uri_and_capabilities():
    name = f"uri-{uuid.uuid4().hex[:8]}"
    storage = open_storage(f"mem://{name}")
    try:
        assert isinstance(storage, MemoryStorage)
        assert storage.uri == f"mem://{name}"
        assert str(storage.root).startswith("/dev/shm/")
        assert storage.capabilities.atomic_rename and not storage.capabilities.durable
        storage.put("a", b"12345")
        assert storage.used_bytes() == 5
        assert any(n.uri == storage.uri and n.bytes == 5 for n in namespaces())
    finally:
        storage.destroy()
    assert not storage.root.exists()


@pytest.mark.parametrize("bad", ["", "..", "a/../b", "/abs", "-x", "a b", "a//b"])
def test_rejects_bad_names(bad):
    from tiersave.errors import ConfigError

    with pytest.raises(ConfigError):
        MemoryStorage(bad)
