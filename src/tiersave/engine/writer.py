"""Write the shards of one checkpoint, computing CRC-32C per chunk on the way."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait
from dataclasses import dataclass, field

from .._crash import crashpoint
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.layout import ALIGN, align_up
from ..storage.base import BlobWriter, Storage

log = logging.getLogger(__name__)


@dataclass
class TensorSource:
    """One tensor to write: its size and a callable returning its bytes (may copy, e.g. from a GPU)."""

    name: str
    nbytes: int
    data: Callable[[], memoryview]


@dataclass
class PlacedTensor:
    source: TensorSource
    shard: int
    offset: int


@dataclass
class ShardLayout:
    file: str
    size: int
    tensors: list[PlacedTensor] = field(default_factory=list)


def plan_layout(
    sources: Sequence[TensorSource], files: Callable[[int], str], *, max_shard_bytes: int | None = None
) -> list[ShardLayout]:
    """Place tensors in order at 4 KiB-aligned offsets, starting a new shard past ``max_shard_bytes``."""
    shards: list[ShardLayout] = []
    cursor = 0
    for src in sources:
        if not shards or (max_shard_bytes is not None and cursor > 0 and cursor + src.nbytes > max_shard_bytes):
            shards.append(ShardLayout(files(len(shards)), 0))
            cursor = 0
        shard = shards[-1]
        shard.tensors.append(PlacedTensor(src, len(shards) - 1, cursor))
        cursor = align_up(cursor + src.nbytes, ALIGN)
        shard.size = cursor
    return shards


class _LazyBytes:
    """Materializes a tensor's bytes once for all its chunks and drops them after the last one."""

    def __init__(self, source: TensorSource, nchunks: int) -> None:
        self._source = source
        self._lock = threading.Lock()
        self._view: memoryview | None = None
        self._remaining = nchunks

    def get(self) -> memoryview:
        with self._lock:
            if self._view is None:
                view = self._source.data()
                if len(view) != self._source.nbytes:
                    raise ValueError(
                        f"tensor {self._source.name!r} produced {len(view)} bytes, expected {self._source.nbytes}"
                    )
                self._view = view
            return self._view

    def done(self) -> None:
        with self._lock:
            self._remaining -= 1
            if self._remaining == 0:
                self._view = None


@dataclass
class WriteResult:
    checksums: dict[str, tuple[str, ...]]
    bytes_written: int
    seconds: float


def write_shards(
    storage: Storage,
    prefix: str,
    shards: Sequence[ShardLayout],
    *,
    chunk_bytes: int,
    executor: Executor,
) -> WriteResult:
    """Write every shard under ``prefix`` and make it durable; on any error abort all and re-raise.

    Chunks of all tensors are written in parallel on ``executor``; each chunk's CRC-32C is computed
    from the same buffer just before it is written.
    """
    start = time.perf_counter()
    writers: list[BlobWriter] = []
    crcs: dict[str, list[str]] = {}
    try:
        futures: list[Future[None]] = []
        for shard in shards:
            writer = storage.open_writer(f"{prefix}/{shard.file}")
            writers.append(writer)
            for placed in shard.tensors:
                ranges = list(chunk_ranges(placed.source.nbytes, chunk_bytes))
                slots = [""] * len(ranges)
                crcs[placed.source.name] = slots
                lazy = _LazyBytes(placed.source, len(ranges))
                for i, (off, length) in enumerate(ranges):
                    futures.append(executor.submit(_write_chunk, writer, lazy, placed.offset, off, length, slots, i))
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in pending:
            fut.cancel()
        wait(pending)  # nothing may still write into a writer we are about to abort
        for fut in done:
            fut.result()  # re-raise the first failure
        crashpoint("after_shard_write")
        for shard, writer in zip(shards, writers):
            writer.finish(shard.size)
        crashpoint("after_shard_fsync")
    except BaseException:
        for writer in writers:
            try:
                writer.abort()
            except Exception:  # the original error matters more than a failed cleanup
                log.warning("could not discard %s after a failed save", writer.key, exc_info=True)
        raise
    total = sum(s.size for s in shards)
    return WriteResult({k: tuple(v) for k, v in crcs.items()}, total, time.perf_counter() - start)


def _write_chunk(
    writer: BlobWriter, lazy: _LazyBytes, base: int, off: int, length: int, slots: list[str], index: int
) -> None:
    try:
        view = lazy.get()[off : off + length]
        slots[index] = crc32c_hex(view)
        writer.write_at(base + off, view)
    finally:
        lazy.done()
