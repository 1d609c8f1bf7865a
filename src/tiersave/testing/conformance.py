"""The conformance suite every :class:`~tiersave.storage.base.Storage` backend must pass.

Use it the way fsspec's ``tests/abstract`` is used: subclass :class:`StorageConformanceTests` in a
pytest module and provide a ``storage`` fixture that yields a fresh, empty storage for each test::

    from tiersave.testing.conformance import StorageConformanceTests

    class TestMyStorage(StorageConformanceTests):
        large_object_bytes = 12 << 20      # optional: big enough to cross the backend's part size

        @pytest.fixture
        def storage(self, tmp_path):
            s = MyStorage(tmp_path)
            yield s
            s.close()

Fixture contract: ``storage`` is empty, usable from several threads, and closed by the fixture.
Class attributes tune sizes. ``reopen(storage)`` returns a second instance on the same data (default:
``open_storage(storage.uri)``); override it when the URI alone does not carry credentials.

What it checks: whole-object put/get (overwrite, create-only, empty, max_bytes), ranged and concurrent
reads, writers (parallel out-of-order ``write_at``, gaps read as zeros, ``finish``, ``abort`` leaves
nothing), head/exists/list/list_dirs (component-wise prefixes), delete/delete_prefix, key validation
(``..``, absolute, NUL, empty components), rename without replace where the backend declares it, and that
every failure is a typed :class:`~tiersave.errors.TiersaveError` subclass.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ..errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    ObjectNotFoundError,
    StorageError,
    TiersaveError,
)
from ..storage import open_storage
from ..storage.base import ObjectInfo, Storage, StorageCapabilities

__all__ = ["BAD_KEYS", "StorageConformanceTests"]

BAD_KEYS = ("", "/abs", "a/../b", "..", "../x", "a//b", "a/./b", ".", "a/", "nul\x00byte", "back\\slash")
"""Keys every backend must reject with ConfigError before touching storage."""


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class StorageConformanceTests:
    """Mix-in of tests; the subclass provides the ``storage`` fixture (see the module docstring)."""

    large_object_bytes: int = 3 << 20
    """A writer test object: large enough to span several of the backend's parts/blocks."""
    write_chunk_bytes: int = 1 << 20
    """Size of the pieces the parallel-writer test writes (the last one is shorter and unaligned)."""

    def reopen(self, storage: Storage) -> Storage:
        """A second instance on the same data; override when ``storage.uri`` lacks credentials."""
        return open_storage(storage.uri)

    # -- identity ---------------------------------------------------------------------------------

    def test_protocol_and_capabilities(self, storage: Storage) -> None:
        assert isinstance(storage, Storage)
        assert isinstance(storage.uri, str)
        assert storage.uri
        assert isinstance(storage.capabilities, StorageCapabilities)

    # -- whole objects ----------------------------------------------------------------------------

    def test_put_get_roundtrip(self, storage: Storage) -> None:
        data = _payload(10_000)
        storage.put("a/b/obj.bin", data)
        assert storage.get("a/b/obj.bin") == data
        storage.put("mv.bin", memoryview(bytearray(data)))
        assert storage.get("mv.bin") == data

    def test_put_empty_object(self, storage: Storage) -> None:
        storage.put("empty", b"")
        assert storage.get("empty") == b""
        assert storage.head("empty").size == 0

    def test_put_overwrite_replaces(self, storage: Storage) -> None:
        storage.put("k", b"old")
        storage.put("k", b"new-content")
        assert storage.get("k") == b"new-content"

    def test_put_create_only_refuses_existing(self, storage: Storage) -> None:
        storage.put("m.json", b"first", mode="create")
        with pytest.raises(AlreadyExistsError) as info:
            storage.put("m.json", b"second", mode="create")
        assert isinstance(info.value, FileExistsError)
        assert storage.get("m.json") == b"first"

    def test_put_create_only_races_have_one_winner(self, storage: Storage) -> None:
        barrier = threading.Barrier(4)
        outcomes: list[str] = []

        def attempt(i: int) -> None:
            barrier.wait()
            try:
                storage.put("race.json", f"writer-{i}".encode(), mode="create")
                outcomes.append(f"writer-{i}")
            except AlreadyExistsError:
                outcomes.append("lost")

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(attempt, range(4)))
        winners = [o for o in outcomes if o != "lost"]
        assert len(winners) == 1, outcomes
        assert storage.get("race.json") == winners[0].encode()

    def test_get_missing(self, storage: Storage) -> None:
        with pytest.raises(ObjectNotFoundError) as info:
            storage.get("no/such/key")
        assert isinstance(info.value, FileNotFoundError)
        assert "no/such/key" in str(info.value)

    def test_get_max_bytes(self, storage: Storage) -> None:
        storage.put("big", b"x" * 1000)
        assert storage.get("big", max_bytes=1000) == b"x" * 1000
        with pytest.raises(FormatError):
            storage.get("big", max_bytes=999)

    def test_visible_through_a_second_instance(self, storage: Storage) -> None:
        storage.put("shared/obj", b"seen")
        other = self.reopen(storage)
        try:
            assert other.get("shared/obj") == b"seen"
        finally:
            other.close()

    # -- readers ----------------------------------------------------------------------------------

    def test_reader_ranges(self, storage: Storage) -> None:
        data = _payload(300_000, seed=1)
        storage.put("r.bin", data)
        reader = storage.open_reader("r.bin")
        try:
            assert reader.size == len(data)
            for offset, length in ((0, 1), (0, 4096), (4095, 2), (123_457, 70_000), (len(data) - 10, 10), (5, 0)):
                out = bytearray(length)
                reader.read_into(offset, memoryview(out))
                assert bytes(out) == data[offset : offset + length], (offset, length)
        finally:
            reader.close()

    def test_reader_past_end_raises(self, storage: Storage) -> None:
        storage.put("short.bin", b"0123456789")
        reader = storage.open_reader("short.bin")
        try:
            with pytest.raises(CorruptCheckpointError):
                reader.read_into(5, memoryview(bytearray(10)))
        finally:
            reader.close()

    def test_reader_concurrent(self, storage: Storage) -> None:
        data = _payload(1 << 20, seed=2)
        storage.put("c.bin", data)
        reader = storage.open_reader("c.bin")
        piece = 64 << 10

        def read(i: int) -> bool:
            out = bytearray(piece)
            reader.read_into(i * piece, memoryview(out))
            return bytes(out) == data[i * piece : (i + 1) * piece]

        try:
            with ThreadPoolExecutor(8) as pool:
                assert all(pool.map(read, range(len(data) // piece)))
        finally:
            reader.close()

    def test_open_reader_missing(self, storage: Storage) -> None:
        with pytest.raises(ObjectNotFoundError):
            storage.open_reader("missing.bin")

    # -- writers ----------------------------------------------------------------------------------

    def _write_parallel(self, storage: Storage, key: str, data: bytes, *, shuffle: bool = True) -> None:
        writer = storage.open_writer(key)
        step = self.write_chunk_bytes
        pieces = [(off, min(step, len(data) - off)) for off in range(0, len(data), step)]
        if shuffle:
            # Roughly in order, as the engines submit, but finishing in any order.
            random.Random(3).shuffle(pieces)
            pieces.sort(key=lambda p: p[0] // (4 * step))
        view = memoryview(data)
        try:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda p: writer.write_at(p[0], view[p[0] : p[0] + p[1]]), pieces))
            writer.finish(len(data))
        except BaseException:
            writer.abort()
            raise

    def test_writer_parallel_out_of_order(self, storage: Storage) -> None:
        data = _payload(self.large_object_bytes + 12_345, seed=4)
        self._write_parallel(storage, "w/large.bin", data)
        assert storage.head("w/large.bin").size == len(data)
        reader = storage.open_reader("w/large.bin")
        try:
            out = bytearray(len(data))
            reader.read_into(0, memoryview(out))
        finally:
            reader.close()
        assert out == data

    def test_writer_small_object(self, storage: Storage) -> None:
        writer = storage.open_writer("w/small.bin")
        writer.write_at(0, memoryview(b"hello"))
        writer.finish(5)
        assert storage.get("w/small.bin") == b"hello"

    def test_writer_empty_object(self, storage: Storage) -> None:
        writer = storage.open_writer("w/empty.bin")
        writer.finish(0)
        assert storage.head("w/empty.bin").size == 0

    def test_writer_gaps_read_as_zeros(self, storage: Storage) -> None:
        size = self.large_object_bytes
        writer = storage.open_writer("w/gaps.bin")
        writer.write_at(4096, memoryview(b"\x01" * 100))
        writer.write_at(size - 8192, memoryview(b"\x02" * 4096))
        writer.finish(size)
        data = storage.get("w/gaps.bin")
        expected = bytearray(size)
        expected[4096:4196] = b"\x01" * 100
        expected[size - 8192 : size - 4096] = b"\x02" * 4096
        assert len(data) == size
        assert data == expected

    def test_writer_abort_leaves_nothing(self, storage: Storage) -> None:
        data = _payload(self.large_object_bytes, seed=5)
        writer = storage.open_writer("w/aborted.bin")
        view = memoryview(data)
        step = self.write_chunk_bytes
        for off in range(0, len(data) - step, step):
            writer.write_at(off, view[off : off + step])
        writer.abort()
        writer.abort()  # idempotent
        assert not storage.exists("w/aborted.bin")
        assert [i.key for i in storage.list("w")] == []

    def test_writer_abort_after_finish_discards(self, storage: Storage) -> None:
        writer = storage.open_writer("w/done.bin")
        writer.write_at(0, memoryview(b"abc"))
        writer.finish(3)
        writer.abort()
        assert not storage.exists("w/done.bin")

    def test_writer_refuses_existing_key(self, storage: Storage) -> None:
        storage.put("w/taken", b"x")
        with pytest.raises(AlreadyExistsError):
            storage.open_writer("w/taken")
        assert storage.get("w/taken") == b"x"

    # -- metadata ---------------------------------------------------------------------------------

    def test_head_and_exists(self, storage: Storage) -> None:
        storage.put("h/obj", b"12345")
        info = storage.head("h/obj")
        assert isinstance(info, ObjectInfo)
        assert info.key == "h/obj"
        assert info.size == 5
        assert isinstance(info.mtime, float)
        assert info.mtime > 0
        assert storage.exists("h/obj")
        assert not storage.exists("h/none")
        assert not storage.exists("h")  # a prefix is not an object
        with pytest.raises(ObjectNotFoundError):
            storage.head("h/none")

    def test_list_recursive_and_component_wise(self, storage: Storage) -> None:
        for key in ("d/a", "d/sub/b", "d/sub/deeper/c", "dx/other", "top"):
            storage.put(key, key.encode())
        assert sorted(i.key for i in storage.list("d")) == ["d/a", "d/sub/b", "d/sub/deeper/c"]
        assert sorted(i.key for i in storage.list("")) == ["d/a", "d/sub/b", "d/sub/deeper/c", "dx/other", "top"]
        sizes = {i.key: i.size for i in storage.list("d/sub")}
        assert sizes == {"d/sub/b": 7, "d/sub/deeper/c": 14}
        assert list(storage.list("nothing")) == []

    def test_list_dirs(self, storage: Storage) -> None:
        for key in ("step-1/m", "step-2/x/y", "step-3/z", "loose"):
            storage.put(key, b"1")
        assert storage.list_dirs("") == ["step-1", "step-2", "step-3"]
        assert storage.list_dirs("step-2") == ["x"]
        assert storage.list_dirs("step-1") == []
        assert storage.list_dirs("absent") == []

    # -- deletion ---------------------------------------------------------------------------------

    def test_delete(self, storage: Storage) -> None:
        storage.put("del/a", b"1")
        storage.delete("del/a")
        assert not storage.exists("del/a")
        storage.delete("del/a")  # missing is not an error

    def test_delete_prefix(self, storage: Storage) -> None:
        for key in ("p/a", "p/b/c", "p/b/d/e", "px/keep", "q"):
            storage.put(key, b"1")
        storage.delete_prefix("p")
        assert sorted(i.key for i in storage.list("")) == ["px/keep", "q"]
        storage.delete_prefix("p")  # missing is not an error
        storage.delete_prefix("q")  # a single object
        assert not storage.exists("q")

    # -- keys -------------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_rejects_unsafe_keys(self, storage: Storage, key: str) -> None:
        calls: list[Callable[[], Any]] = [
            lambda: storage.put(key, b"x"),
            lambda: storage.put(key, b"x", mode="create"),
            lambda: storage.get(key),
            lambda: storage.head(key),
            lambda: storage.open_writer(key),
            lambda: storage.open_reader(key),
            lambda: storage.delete(key),
        ]
        if key:  # "" is the root for listing, never for deletion
            calls += [lambda: list(storage.list(key)), lambda: storage.list_dirs(key)]
        calls.append(lambda: storage.delete_prefix(key))
        for call in calls:
            with pytest.raises(ConfigError):
                call()
        assert list(storage.list("")) == []

    # -- rename -----------------------------------------------------------------------------------

    def test_rename_prefix(self, storage: Storage) -> None:
        storage.put("src/a", b"1")
        storage.put("src/b/c", b"2")
        if not storage.capabilities.atomic_rename:
            with pytest.raises(ConfigError):
                storage.rename_prefix("src", "dst")
            return
        storage.rename_prefix("src", "dst")
        assert sorted(i.key for i in storage.list("dst")) == ["dst/a", "dst/b/c"]
        assert list(storage.list("src")) == []

    def test_rename_prefix_never_replaces(self, storage: Storage) -> None:
        storage.put("one/x", b"1")
        storage.put("two/y", b"2")
        expected: type[TiersaveError] = AlreadyExistsError if storage.capabilities.atomic_rename else ConfigError
        with pytest.raises(expected):
            storage.rename_prefix("one", "two")
        assert storage.get("two/y") == b"2"
        assert storage.get("one/x") == b"1"
        assert sorted(i.key for i in storage.list("")) == ["one/x", "two/y"]

    # -- errors -----------------------------------------------------------------------------------

    def test_errors_are_typed(self, storage: Storage) -> None:
        probes: list[Callable[[], Any]] = [
            lambda: storage.get("none"),
            lambda: storage.head("none"),
            lambda: storage.open_reader("none"),
            lambda: storage.get("../x"),
        ]
        for probe in probes:
            with pytest.raises(TiersaveError) as info:
                probe()
            assert isinstance(info.value, (StorageError, ConfigError)), type(info.value)

    def test_threads_share_one_instance(self, storage: Storage) -> None:
        def work(i: int) -> bool:
            key = f"t/{i}/obj"
            data = os.urandom(1000 + i)
            storage.put(key, data)
            return storage.get(key) == data and storage.head(key).size == len(data)

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(work, range(32)))
        assert len(storage.list_dirs("t")) == 32
