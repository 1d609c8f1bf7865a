"""Read tensors of one checkpoint into caller-provided memory, verifying every chunk's CRC-32C.

Scope: one parallel read of many tensors' chunks from open shard readers, each chunk checked before it
counts as read. Anti-scope: choosing destinations (restore.py), opening shards and validating manifests
(catalog.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from .._futures import wait_all
from ..errors import CorruptCheckpointError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.manifest import TensorEntry
from ..storage.base import BlobReader


@dataclass
class ReadRequest:
    """Read ``entry``'s bytes into ``dest`` (exactly ``entry.nbytes`` long)."""

    entry: TensorEntry
    dest: memoryview


def read_tensors(
    reader_for: Callable[[int], BlobReader],
    requests: Sequence[ReadRequest],
    *,
    chunk_bytes: int,
    executor: Executor,
    describe: Callable[[TensorEntry], tuple[str, int | None]],
) -> float:
    """Read all requests in parallel chunks; raise :class:`CorruptCheckpointError` on any mismatch.

    Args:
        reader_for: returns the open reader of a shard index.
        describe: returns ``(shard file, step)`` of an entry, for error messages.

    Returns:
        Seconds spent.
    """
    start = time.perf_counter()
    futures: list[Future[None]] = []
    for req in requests:
        if len(req.dest) != req.entry.nbytes:
            raise ValueError(f"destination for {req.entry.name!r} has {len(req.dest)} bytes, need {req.entry.nbytes}")
        reader = reader_for(req.entry.shard)
        for i, (off, length) in enumerate(chunk_ranges(req.entry.nbytes, chunk_bytes)):
            futures.append(executor.submit(_read_chunk, reader, req, i, off, length, describe))
    wait_all(futures)
    return time.perf_counter() - start


def _read_chunk(
    reader: BlobReader,
    req: ReadRequest,
    index: int,
    off: int,
    length: int,
    describe: Callable[[TensorEntry], tuple[str, int | None]],
) -> None:
    view = req.dest[off : off + length]
    reader.read_into(req.entry.offset + off, view)
    actual = crc32c_hex(view)
    expected = req.entry.crc32c[index]
    if actual != expected:
        file, step = describe(req.entry)
        raise CorruptCheckpointError(
            f"checksum mismatch in step {step}, file {file}, tensor {req.entry.name!r}, chunk {index} "
            f"(bytes {req.entry.offset + off}..{req.entry.offset + off + length}): "
            f"expected {expected}, got {actual}",
            step=step,
            file=file,
            tensor=req.entry.name,
        )
