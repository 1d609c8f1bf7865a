"""Read tensors of one checkpoint into caller-provided memory, verifying every chunk's CRC-32C.

Scope: one parallel read of many tensors' chunks from open shard readers, each chunk checked before it
counts as read (by a CRC the storage's reader took while it copied the bytes in, where it offers one:
``ChecksumReader``); runs of small tensors read as groups (one read, one job per group); runs of consecutive
medium tensors (one checksum chunk each, a few MiB: an MoE's experts) read straight into their
destinations by one vectored request per run. Anti-scope: choosing destinations (restore.py), opening
shards and validating manifests (catalog.py), how a storage serves a run (``read_ranges``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from .._futures import wait_all
from ..errors import CorruptCheckpointError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.layout import ALIGN
from ..format.manifest import TensorEntry
from ..storage.base import BlobReader, ChecksumReader, RangesReader


@dataclass
class ReadRequest:
    """Read ``entry``'s bytes into ``dest`` (exactly ``entry.nbytes`` long).

    ``verify=False`` reads them without checking their CRC-32C: only for bytes whose check another process
    makes on the same bytes (the ranks of one machine splitting the replicated state, restore.py), which must
    then call :func:`verify_in_memory` if that check turns out not to cover them."""

    entry: TensorEntry
    dest: memoryview
    verify: bool = True


SMALL_READ_BYTES = 1 << 20
"""Tensors up to this size (and one checksum chunk) are read in groups: one read of the file range that holds a
run of them, then a checksum and a copy per tensor, instead of a job and a future per tensor."""

GROUP_READ_BYTES = 8 << 20
"""The most bytes one group read spans (padding and gaps included)."""

_MAX_GAP = 64 << 10  # a gap wider than this between two small tensors starts a new group (not worth reading)

RUN_READ_BYTES = 64 << 20
"""The most bytes one run of medium tensors spans: the size of a large tensor's chunk read, so that a state
of many expert tensors puts as many bytes in flight per request as the same bytes in a few tensors."""

_RUNS_PER_READ = 8
"""Runs are cut to at most 1/8 of the medium bytes, so that a smaller state still keeps every I/O thread
busy (reads and checksums in parallel)."""


def read_tensors(
    reader_for: Callable[[int], BlobReader],
    requests: Sequence[ReadRequest],
    *,
    chunk_bytes: int,
    executor: Executor,
    describe: Callable[[TensorEntry], tuple[str, int | None]],
) -> float:
    """Read all requests in parallel chunks; raise :class:`CorruptCheckpointError` on any mismatch.

    Large tensors are read chunk by chunk straight into their destination, each chunk verified after it
    lands. Small ones are read in groups into a scratch buffer, and each is verified there before its bytes
    are copied to its destination (a mismatch names that tensor).

    Args:
        reader_for: returns the open reader of a shard index.
        describe: returns ``(shard file, step)`` of an entry, for error messages.

    Returns:
        Seconds spent.
    """
    start = time.perf_counter()
    futures: list[Future[None]] = []
    small_limit = min(SMALL_READ_BYTES, chunk_bytes)
    small: list[tuple[int, int, ReadRequest]] = []
    medium: list[tuple[int, int, ReadRequest]] = []
    for req in requests:
        entry = req.entry
        if len(req.dest) != entry.nbytes:
            raise ValueError(f"destination for {entry.name!r} has {len(req.dest)} bytes, need {entry.nbytes}")
        if entry.nbytes <= small_limit:
            if entry.nbytes:
                small.append((entry.shard, entry.offset, req))
            continue
        if entry.nbytes <= chunk_bytes:
            medium.append((entry.shard, entry.offset, req))
            continue
        reader = reader_for(entry.shard)
        for i, (off, length) in enumerate(chunk_ranges(entry.nbytes, chunk_bytes)):
            futures.append(executor.submit(_read_chunk, reader, req, i, off, length, describe))
    small.sort(key=lambda item: (item[0], item[1]))
    group: list[ReadRequest] = []
    g_shard = g_start = g_end = -1
    for shard, offset, req in small:
        end = offset + req.entry.nbytes
        if group and shard == g_shard and g_end + _MAX_GAP >= offset and max(end, g_end) - g_start <= GROUP_READ_BYTES:
            group.append(req)
            g_end = max(g_end, end)
            continue
        if group:
            futures.append(executor.submit(_read_group, reader_for(g_shard), group, g_start, g_end, describe))
        group, g_shard, g_start, g_end = [req], shard, offset, end
    if group:
        futures.append(executor.submit(_read_group, reader_for(g_shard), group, g_start, g_end, describe))
    for shard, run in _runs(medium):
        futures.append(executor.submit(_read_run, reader_for(shard), run, describe))
    wait_all(futures)
    return time.perf_counter() - start


def _runs(medium: list[tuple[int, int, ReadRequest]]) -> list[tuple[int, list[ReadRequest]]]:
    """Medium tensors cut into runs: consecutive in one shard (only alignment padding between them), each
    spanning at most ``RUN_READ_BYTES`` and about an eighth of all of them."""
    medium.sort(key=lambda item: (item[0], item[1]))
    limit = min(RUN_READ_BYTES, max(1, sum(r.entry.nbytes for _, _, r in medium) // _RUNS_PER_READ))
    runs: list[tuple[int, list[ReadRequest]]] = []
    run: list[ReadRequest] = []
    r_shard = r_start = r_end = -1
    for shard, offset, req in medium:
        end = offset + req.entry.nbytes
        if run and shard == r_shard and r_end <= offset < r_end + ALIGN and end - r_start <= limit:
            run.append(req)
            r_end = end
            continue
        if run:
            runs.append((r_shard, run))
        run, r_shard, r_start, r_end = [req], shard, offset, end
    if run:
        runs.append((r_shard, run))
    return runs


def _read_run(
    reader: BlobReader, run: list[ReadRequest], describe: Callable[[TensorEntry], tuple[str, int | None]]
) -> None:
    """Read a run of single-chunk tensors into their destinations in one call where the reader can, then
    verify each (a mismatch names that tensor)."""
    if all(req.verify for req in run) and isinstance(reader, ChecksumReader):
        # the CRCs taken as the bytes are copied out (a run mixing checked and unchecked tensors, rare, is
        # read plainly below so that the unchecked ones pay for no checksum)
        if len(run) == 1:
            crcs = [reader.read_into_crc(run[0].entry.offset, run[0].dest)]
        else:
            crcs = reader.read_ranges_crc([(req.entry.offset, req.dest) for req in run])
        for req, crc in zip(run, crcs, strict=True):
            if f"{crc:08x}" != req.entry.crc32c[0]:
                _mismatch(req.entry, 0, req.entry.offset, req.entry.nbytes, f"{crc:08x}", describe)
        return
    if len(run) > 1 and isinstance(reader, RangesReader):
        reader.read_ranges([(req.entry.offset, req.dest) for req in run])
    else:
        for req in run:
            reader.read_into(req.entry.offset, req.dest)
    for req in run:
        entry = req.entry
        if not req.verify:
            continue
        actual = crc32c_hex(req.dest)
        if actual != entry.crc32c[0]:
            _mismatch(entry, 0, entry.offset, entry.nbytes, actual, describe)


def _read_group(
    reader: BlobReader,
    group: list[ReadRequest],
    start: int,
    end: int,
    describe: Callable[[TensorEntry], tuple[str, int | None]],
) -> None:
    """Read the file range ``[start, end)`` once; verify each tensor in it, then copy it to its destination."""
    scratch = memoryview(bytearray(end - start))
    reader.read_into(start, scratch)
    for req in group:
        entry = req.entry
        off = entry.offset - start
        view = scratch[off : off + entry.nbytes]
        if req.verify:
            actual = crc32c_hex(view)
            if actual != entry.crc32c[0]:
                _mismatch(entry, 0, entry.offset, entry.nbytes, actual, describe)
        dest = req.dest
        if dest.format != "B" or dest.ndim != 1:
            dest = dest.cast("B")
        dest[:] = view


def _read_chunk(
    reader: BlobReader,
    req: ReadRequest,
    index: int,
    off: int,
    length: int,
    describe: Callable[[TensorEntry], tuple[str, int | None]],
) -> None:
    view = req.dest[off : off + length]
    if req.verify and isinstance(reader, ChecksumReader):  # the CRC taken as the bytes are copied out
        actual = f"{reader.read_into_crc(req.entry.offset + off, view):08x}"
        if actual != req.entry.crc32c[index]:
            _mismatch(req.entry, index, req.entry.offset + off, length, actual, describe)
        return
    reader.read_into(req.entry.offset + off, view)
    if req.verify:
        _check(req, index, off, length, describe)


def _check(
    req: ReadRequest, index: int, off: int, length: int, describe: Callable[[TensorEntry], tuple[str, int | None]]
) -> None:
    """Chunk ``index`` of ``req`` (``length`` bytes at ``off`` in the tensor) against its checksum, in ``dest``."""
    actual = crc32c_hex(req.dest[off : off + length])
    if actual != req.entry.crc32c[index]:
        _mismatch(req.entry, index, req.entry.offset + off, length, actual, describe)


def verify_in_memory(
    requests: Sequence[ReadRequest],
    *,
    chunk_bytes: int,
    executor: Executor,
    describe: Callable[[TensorEntry], tuple[str, int | None]],
) -> None:
    """Check every chunk of ``requests`` against its CRC-32C in its destination (bytes read before with
    ``verify=False``), in parallel; raise :class:`CorruptCheckpointError` naming the first bad chunk."""
    futures = [
        executor.submit(_check, req, i, off, length, describe)
        for req in requests
        for i, (off, length) in enumerate(chunk_ranges(req.entry.nbytes, chunk_bytes))
    ]
    wait_all(futures)


def _mismatch(
    entry: TensorEntry,
    index: int,
    start: int,
    length: int,
    actual: str,
    describe: Callable[[TensorEntry], tuple[str, int | None]],
) -> None:
    file, step = describe(entry)
    raise CorruptCheckpointError(
        f"checksum mismatch in step {step}, file {file}, tensor {entry.name!r}, chunk {index} "
        f"(bytes {start}..{start + length}): expected {entry.crc32c[index]}, got {actual}",
        step=step,
        file=file,
        tensor=entry.name,
    )
