"""The S3 writer's upload window against the real SeaweedFS: a write that waits for earlier bytes that never
come (an earlier write failed, or was never issued) ends, with the failure that stopped the object or with a
``StorageError`` once the window has not moved for its bound; a staged save whose first write fails does not hang
on writes waiting behind it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tiersave
from tiersave.errors import StorageError
from tiersave.testing.faults import FaultyStorage

pytestmark = pytest.mark.s3

MiB = 1 << 20
# two 5 MiB parts of window; the stall bound is 2 x timeout + retry_timeout = 3 s
WINDOW = {"part_size": "5MiB", "write_buffer": "10MiB", "timeout": "1s", "retry_timeout": "1s", "retries": "1"}


@pytest.fixture
def storage(seaweed, s3_bucket):
    store = seaweed.storage(s3_bucket, "w", **WINDOW)
    yield store
    store.close()


def test_a_write_past_the_window_above_a_gap_that_never_fills_raises_after_the_bound(storage):
    writer = storage.open_writer("gap/object")
    try:
        writer.write_at(5 * MiB, memoryview(bytes(MiB)))  # inside the window: buffered
        start = time.monotonic()
        with pytest.raises(StorageError, match=r"waited 3 s for the bytes from byte 0 on, which no write brought"):
            writer.write_at(12 * MiB, memoryview(bytes(MiB)))  # past it, and byte 0 never comes
        assert time.monotonic() - start < 60  # bounded (3 s here), not forever
    finally:
        writer.abort()
    assert storage.list_multipart_uploads("") == []


def test_interrupt_ends_a_write_waiting_for_the_window_with_the_callers_error(storage):
    writer = storage.open_writer("gap/interrupted")
    outcome: list[BaseException] = []

    def blocked() -> None:
        try:
            writer.write_at(12 * MiB, memoryview(bytes(MiB)))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    try:
        time.sleep(0.2)  # let it wait (if it has not yet, it sees the error on its first look)
        writer.interrupt(RuntimeError("another write of this object failed"))
        thread.join(2.5)  # well before the 3 s bound
        assert not thread.is_alive()
        assert len(outcome) == 1 and "another write of this object failed" in str(outcome[0])
    finally:
        writer.abort()
        thread.join(10)


class _FirstWriteFailsLate:
    """A shard writer whose write at byte 0 fails after 1.5 s: by then the other writer threads have filled the
    window behind it and wait in ``write_at`` for byte 0."""

    def __init__(self, inner) -> None:
        self._inner, self.key = inner, inner.key

    def write_at(self, offset, data) -> None:
        if offset == 0:
            time.sleep(1.5)
            raise StorageError("injected: the first write failed late", tier="test", key=self.key)
        self._inner.write_at(offset, data)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _LateFailure(FaultyStorage):
    def open_writer(self, key, *, size_hint=None):
        return _FirstWriteFailsLate(super().open_writer(key, size_hint=size_hint))


def test_a_staged_save_whose_first_write_fails_fails_at_once_not_after_the_bound(seaweed, s3_bucket):
    """The first write (byte 0 of the shard) fails late, while the writes past the window wait for it. The
    failure interrupts them, so the save fails with its error at once, not after the window's bound."""
    inner = seaweed.storage(s3_bucket, "save", **{**WINDOW, "timeout": "20s", "retry_timeout": "20s"})
    state = {f"w{i}": torch.randn(1 << 20) for i in range(10)}  # 40 MiB: one shard, 20 writes of 2 MiB
    try:
        with tiersave.Checkpointer(_LateFailure(inner), io_threads=4, chunk_bytes=2 << 20, event_log=False) as ckpt:
            start = time.monotonic()
            with pytest.raises(StorageError, match="the first write failed late"):
                ckpt.save(1, state)
            assert time.monotonic() - start < 30  # the bound alone: 60 s for each waiting write
            assert ckpt.list() == []
        assert inner.list_multipart_uploads("") == []
    finally:
        inner.close()


def test_an_incremental_save_with_an_unchanged_piece_below_a_changed_one_past_the_window(seaweed, s3_bucket):
    """An incremental save fills its unchanged pieces from the base after every write; a changed piece more than
    the window past an unchanged one waited for it for good (3 s and a StorageError with this bound). The
    writer stops holding writes to the window once a piece is left for later, and the save commits."""
    inner = seaweed.storage(s3_bucket, "inc", **WINDOW)
    w = torch.randn(10 << 20)  # 40 MiB: one shard, 20 chunks of 2 MiB, eight times the window
    try:
        with tiersave.Checkpointer(inner, incremental=True, chunk_bytes=2 << 20, io_threads=4, event_log=False) as ck:
            ck.save(1, {"w": w})
            w[-1000:] += 1  # only the last chunk changes
            handle = ck.save(2, {"w": w})
            assert handle.stats.extra.get("referenced_bytes", 0) == 0  # the shard is written, partly from the base
            assert torch.equal(ck.restore(2)["w"], w) and ck.catalog.verify(2).ok
    finally:
        inner.close()


def test_a_lazy_save_whose_eager_bytes_lie_past_the_window_above_guarded_ones(seaweed, s3_bucket):
    """A lazy save writes its unguarded tensors first and the guarded ones in later phases: here the guarded
    weight (16 MiB) lies first in the shard, so the eager writes past the window waited for bytes that only the
    later phases, queued behind them, bring. The writer does not hold phased writes to the window."""
    inner = seaweed.storage(s3_bucket, "lazy", **WINDOW)
    model = torch.nn.Linear(2048, 2048, bias=False)  # 16 MiB, changed only through the guarded optimizer
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = torch.randn(10 << 20)  # 40 MiB the guard knows nothing of: copied and written at once
    state = {"model": model, "extra": extra}
    expected = {"weight": model.weight.detach().clone(), "extra": extra.clone()}
    try:
        with tiersave.Checkpointer(inner, guard=[optim], chunk_bytes=2 << 20, io_threads=4, event_log=False) as ck:
            ck.save_async(1, state, lazy=True).result(60)
            restored = ck.restore(1)
        assert torch.equal(restored["model"]["weight"], expected["weight"])
        assert torch.equal(restored["extra"], expected["extra"])
    finally:
        inner.close()
