"""Copy committed checkpoints between any two storages, verifying every chunk on the way.

Scope: one committed checkpoint from a source :class:`~tiersave.storage.base.Storage` to a destination
one (memory -> local -> object store as a background drain, or ``tiersave copy`` to migrate between
clusters and buckets). Chunks stream through a bounded pool of reusable buffers: each chunk is read from
the source, checked against the manifest's CRC-32C, and written at the same offset on the destination.
The destination copy is written with the destination's own commit protocol (``commit_for``), so it
becomes visible only once complete, and, with ``read_back=True``, only after every chunk was read back
from the destination and checked again. Anti-scope: deciding what to copy when (the TierChain), torch.

With ``compress="zstd"`` the destination's shards are written compressed (docs/format.md section 10): the
worker threads read a frame, check its chunks, split and compress it, and the calling thread writes the
frames of each shard in order. A compressed source is decoded on the way (every frame checked before it is
decoded), so a copy to a tier without compression writes plain shards.

Memory: at most ``buffer_bytes`` (default 256 MiB, at least two chunks) of chunk buffers, plus what the
destination's writer buffers (an S3 writer's ``write_buffer``). A compressed copy holds as many frames in
flight, each with its decoded and stored bytes and, while compressing, its byte-plane copy: about three
times ``buffer_bytes`` at most.

Thread safety: ``copy_checkpoint`` may run concurrently for different steps or destinations; one call
uses the caller's thread to schedule and ``io_threads`` workers to move bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from . import knobs
from .catalog import Catalog, OpenCheckpoint
from .commit import commit_for
from .engine.codec import DecodingReader, encode_frame, plan_frames, require_codec
from .engine.ordering import interrupt
from .errors import AlreadyExistsError, ConfigError, CorruptCheckpointError
from .events import drained_event
from .format.checksum import chunk_ranges, crc32c_hex
from .format.encoding import Encoding, Frame
from .format.layout import MANIFEST_NAME, shard_filename, step_dirname
from .format.manifest import Manifest, ShardInfo
from .storage.base import BlobReader, BlobWriter, Storage
from .storage.posix.buffers import aligned_buffer

log = logging.getLogger(__name__)

__all__ = ["CopyResult", "copy_checkpoint", "copy_checkpoints", "copy_shards", "destination_names", "same_checkpoint"]

DEFAULT_BUFFER_BYTES = 256 << 20


@dataclass(frozen=True)
class CopyResult:
    """One checkpoint copied (or found already present).

    Attributes:
        step: the step.
        source: URI of the source checkpoint.
        destination: URI of the destination checkpoint.
        tensor_bytes: tensor bytes copied and verified (0 when skipped).
        stored_bytes: shard bytes of the checkpoint, padding included (an incremental drain: of the shards it
            copied, not of those it referenced).
        seconds: wall time.
        skipped: the destination already held this very checkpoint; nothing was written.
        read_back: every chunk was read back from the destination and verified before the commit.
        file_bytes: bytes of the destination's shard files (less than ``stored_bytes`` when compressed).
        referenced_bytes: an incremental drain: bytes of the shards it referenced on the destination instead of
            copying them (``ShardRefs.referenced_bytes``); None for a full copy.
    """

    step: int
    source: str
    destination: str
    tensor_bytes: int
    stored_bytes: int
    seconds: float
    skipped: bool = False
    read_back: bool = False
    file_bytes: int = 0
    referenced_bytes: int | None = None

    @property
    def bytes_per_s(self) -> float:
        return self.tensor_bytes / self.seconds if self.seconds > 0 else 0.0

    def drained_event(self, seconds: float) -> dict[str, Any]:
        """The sizes and speed a tier's ``drained`` event records (what ``tiersave stats`` sums per tier)."""
        return drained_event(seconds, self.stored_bytes, self.file_bytes, referenced_bytes=self.referenced_bytes)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 6)}


@dataclass(frozen=True)
class _Chunk:
    shard: int
    offset: int  # in the shard
    length: int
    crc: str
    tensor: str
    index: int


class References(Protocol):
    """An incremental drain's plan (``drain_refs.ShardRefs``): copy ``work``, the source manifest cut to the
    shards to copy (``copied``: their indices in the source), then ``complete`` the destination manifest, and
    ``check_present`` what it references right before the commit."""

    @property
    def work(self) -> Manifest: ...
    @property
    def copied(self) -> Sequence[int]: ...
    @property
    def referenced_bytes(self) -> int: ...
    def complete(self, written: Manifest) -> Manifest: ...
    def check_present(self) -> None: ...


def same_checkpoint(a: Manifest, b: Manifest) -> bool:
    """True when two manifests describe the same checkpoint (same step, commit time, tensors and bytes),
    wherever its shards are stored."""
    if (a.step, a.created_at, a.chunk_bytes) != (b.step, b.created_at, b.chunk_bytes):
        return False
    if a.tensors.keys() != b.tensors.keys():
        return False
    for name, ta in a.tensors.items():
        tb = b.tensors[name]
        if (ta.dtype, ta.shape, ta.nbytes, ta.crc32c) != (tb.dtype, tb.shape, tb.nbytes, tb.crc32c):
            return False
    return bool(a.tree == b.tree)


def destination_names(manifest: Manifest) -> list[str]:
    """Single-component shard names for the destination (it may add its own attempt prefix)."""
    names = [s.file.rsplit("/", 1)[-1] for s in manifest.shards]
    if len(set(names)) == len(names):
        return names
    return [shard_filename(s.rank, i) for i, s in enumerate(manifest.shards)]


def cut(manifest: Manifest, keep: Sequence[int]) -> Manifest:
    """``manifest`` with only the shards ``keep`` (indices, in that order) and their tensors, renumbered: the
    part of a checkpoint one copy moves."""
    position = {old: new for new, old in enumerate(keep)}
    tensors = {
        n: dataclasses.replace(t, shard=position[t.shard]) for n, t in manifest.tensors.items() if t.shard in position
    }
    return dataclasses.replace(manifest, shards=tuple(manifest.shards[i] for i in keep), tensors=tensors)


def _buffers(threads: int, buffer_bytes: int | None, chunk_bytes: int) -> int:
    """Chunk buffers of a copy: one per thread and one more, within ``buffer_bytes`` (at least two)."""
    budget = buffer_bytes if buffer_bytes is not None else DEFAULT_BUFFER_BYTES
    return max(2, min(threads + 1, budget // chunk_bytes))


def _chunks(manifest: Manifest) -> list[_Chunk]:
    out = []
    for entry in sorted(manifest.tensors.values(), key=lambda t: (t.shard, t.offset)):
        for i, (off, length) in enumerate(chunk_ranges(entry.nbytes, manifest.chunk_bytes)):
            out.append(_Chunk(entry.shard, entry.offset + off, length, entry.crc32c[i], entry.name, i))
    return out


class _Pump:
    """Runs a function over chunks on a pool, each with a buffer from a bounded set; stops at the first
    error and re-raises it after every started task has returned."""

    def __init__(
        self, executor: Executor, buffers: int, chunk_bytes: int, on_error: Callable[[BaseException], object] = repr
    ) -> None:
        self.executor = executor
        self.on_error = on_error  # called once, with the first error (the writers' waits end with it)
        self.free: queue.Queue[memoryview] = queue.Queue()
        for _ in range(buffers):
            self.free.put(aligned_buffer(chunk_bytes))
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def run(self, chunks: Iterable[_Chunk], work: Callable[[_Chunk, memoryview], None]) -> None:
        futures: list[Future[None]] = []
        for chunk in chunks:
            buf = self.free.get()
            if self.error is not None:
                self.free.put(buf)
                break
            futures.append(self.executor.submit(self._task, work, chunk, buf))
        wait(futures)
        if self.error is not None:
            raise self.error

    def _task(self, work: Callable[[_Chunk, memoryview], None], chunk: _Chunk, buf: memoryview) -> None:
        try:
            if self.error is None:
                work(chunk, buf[: chunk.length])
        except BaseException as exc:
            with self.lock:
                first = self.error is None
                if first:
                    self.error = exc
            if first:
                self.on_error(exc)
        finally:
            self.free.put(buf)


def copy_checkpoint(
    src: Storage | Catalog,
    dst: Storage,
    step: int,
    *,
    if_exists: Literal["error", "skip"] = "error",
    read_back: bool = False,
    io_threads: int | None = None,
    buffer_bytes: int | None = None,
    executor: Executor | None = None,
    progress: Callable[[int, int], None] | None = None,
    compress: str | None = None,
    refs: References | None = None,
) -> CopyResult:
    """Copy the committed checkpoint of ``step`` from ``src`` to ``dst``, verified, atomically.

    Every chunk read from ``src`` is checked against the manifest's CRC-32C before it is written, so a
    corrupt source is detected and nothing is committed on ``dst``. The destination copy is committed
    with ``commit_for(dst)`` (rename or create-only manifest) only after every shard is durable there and,
    with ``read_back``, re-read and verified. On any failure the destination's partial data is removed
    and the error re-raised; a committed checkpoint on ``dst`` is never modified.

    Args:
        src: where the checkpoint is committed, or its catalog (whose cached manifest is then used: a drain
            from the first tier parses nothing again).
        dst: where to copy it.
        step: the step.
        if_exists: ``"error"``: raise :class:`AlreadyExistsError` if ``dst`` has ``step``; ``"skip"``:
            return a skipped result if ``dst`` holds the same checkpoint (and still raise if it holds a
            different checkpoint of that step).
        read_back: re-read every chunk from ``dst`` and verify it before committing.
        io_threads: parallel chunk transfers (default ``TIERSAVE_IO_THREADS``).
        buffer_bytes: memory for chunk buffers (default 256 MiB; at least two chunks are used).
        executor: run transfers on this pool instead of a private one.
        progress: called with ``(bytes_done, bytes_total)`` after each chunk (from worker threads).
        compress: None writes plain shards; ``"zstd"`` writes them compressed (format 3.0).
        refs: an incremental drain (drain_refs.py): only ``refs.work``'s shards are copied, the others
            referenced on ``dst``.

    Returns:
        What was copied.

    Raises:
        CheckpointNotFoundError: ``src`` has no committed checkpoint of ``step``.
        CorruptCheckpointError: a source chunk (or, with ``read_back``, a destination chunk) failed its
            checksum, or a shard has the wrong size.
        AlreadyExistsError: ``dst`` already has ``step`` (see ``if_exists``), or another writer committed
            it while copying.
        StorageError: I/O on either side failed.
    """
    if if_exists not in ("error", "skip"):
        raise ConfigError(f"if_exists must be 'error' or 'skip', got {if_exists!r}")
    if compress is not None:
        require_codec(compress)
    started = time.perf_counter()
    source = src if isinstance(src, Catalog) else Catalog(src)
    full = source.manifest(step)
    manifest, index = (refs.work, refs.copied) if refs is not None else (full, range(len(full.shards)))
    src_location = source.location(step)
    dst_location = f"{dst.uri.rstrip('/')}/{step_dirname(step)}"
    existing = _existing(dst, step)
    if existing is not None:
        if if_exists == "skip" and same_checkpoint(existing, full):
            return CopyResult(
                step, src_location, dst_location, 0, full.stored_bytes, time.perf_counter() - started, skipped=True
            )
        detail = "the same checkpoint" if same_checkpoint(existing, full) else "a different checkpoint"
        raise AlreadyExistsError(
            f"{dst.uri} already has step {step} ({detail}); a checkpoint is never overwritten",
            tier=dst.uri,
            key=step_dirname(step),
        )

    threads = io_threads if io_threads is not None else knobs.io_threads()
    if not isinstance(threads, int) or threads < 1:
        raise ConfigError(f"io_threads must be a positive integer, got {threads!r}")
    nbuffers = _buffers(threads, buffer_bytes, manifest.chunk_bytes)
    own_pool = executor is None
    pool = executor or ThreadPoolExecutor(threads, thread_name_prefix="tiersave-copy")
    commit = commit_for(dst)
    prefix = commit.begin(step)
    names = destination_names(manifest)
    writers: list[BlobWriter] = []
    total = manifest.total_bytes
    done = [0]
    done_lock = threading.Lock()

    def advance(n: int) -> None:
        if progress is None:
            return
        with done_lock:
            done[0] += n
            value = done[0]
        progress(value, total * (2 if read_back else 1))

    try:
        with source.open(step) as ckpt:
            _open_writers(ckpt, index, dst, prefix, names, manifest, writers)
            encodings: list[Encoding | None] = [None] * len(manifest.shards)
            if compress is None:
                _write_plain(ckpt, index, manifest, writers, pool, nbuffers, src_location, advance)
            else:
                encodings = list(
                    _write_encoded(
                        lambda i: ckpt.reader(index[i]), manifest, writers, pool, nbuffers, src_location, advance
                    )
                )
        new_manifest = dataclasses.replace(
            manifest,
            shards=tuple(
                ShardInfo(commit.shard_file(prefix, name), s.rank, s.size, encoding=enc)
                for name, s, enc in zip(names, manifest.shards, encodings)
            ),
        )
        written = new_manifest
        if refs is not None:
            new_manifest = refs.complete(new_manifest)
        data = new_manifest.to_json()
        Manifest.parse(data, path=f"{dst_location}/{MANIFEST_NAME}", expect_step=step)
        if read_back:
            _read_back(dst, prefix, names, written, dst_location, pool, nbuffers, advance)
        if refs is not None:  # last, right before the commit: a retention elsewhere may have run meanwhile
            refs.check_present()
        commit.commit(prefix, step, data)
    except BaseException:
        _discard(writers)
        try:
            commit.abort(prefix)
        except Exception:
            log.warning("could not remove %s from %s after a failed copy", prefix, dst.uri, exc_info=True)
        raise
    finally:
        if own_pool:
            pool.shutdown(wait=True)
    return CopyResult(
        step,
        src_location,
        dst_location,
        manifest.total_bytes,
        manifest.stored_bytes,
        time.perf_counter() - started,
        read_back=read_back,
        file_bytes=written.file_bytes,
        referenced_bytes=refs.referenced_bytes if refs is not None else None,
    )


def copy_shards(
    src: Catalog,
    dst: Storage,
    manifest: Manifest,
    prefix: str,
    shards: Sequence[int],
    *,
    executor: Executor,
    io_threads: int,
    buffer_bytes: int | None = None,
) -> dict[str, int]:
    """Copy the shards ``shards`` (indices) of the committed checkpoint ``manifest`` of ``src`` (a catalog, which
    may hold only these shards), verified, into the attempt ``prefix`` on ``dst`` (from ``commit_for(dst).begin``),
    without a commit: one node's part of a checkpoint whose other shards other processes copy into the same
    attempt (partdrain.py). The transfer of :func:`copy_checkpoint`, on ``executor`` (``io_threads`` threads)
    with ``buffer_bytes`` as there; each shard is durable on ``dst`` when this returns.

    Returns:
        The destination name (single component, as :func:`destination_names`) -> size of each shard written.

    Raises:
        CorruptCheckpointError: a source chunk failed its checksum, or a shard has the wrong size.
        StorageError: I/O on either side failed. What this call wrote is removed first.
    """
    chosen = sorted(set(shards))
    every = destination_names(manifest)
    names = [every[i] for i in chosen]
    work = cut(manifest, chosen)
    writers: list[BlobWriter] = []
    try:
        with src.open(manifest.step) as ckpt:
            _open_writers(ckpt, chosen, dst, prefix, names, work, writers)
            nbuffers = _buffers(io_threads, buffer_bytes, work.chunk_bytes)
            _write_plain(ckpt, chosen, work, writers, executor, nbuffers, src.location(manifest.step), lambda n: None)
    except BaseException:
        _discard(writers)
        raise
    return {name: shard.size for name, shard in zip(names, work.shards)}


def _open_writers(ckpt: OpenCheckpoint, index: Sequence[int], dst: Storage, prefix: str, names: Sequence[str],
                  manifest: Manifest, writers: list[BlobWriter]) -> None:  # fmt: skip
    """Open (and size-check) the source shards ``index`` before writing anything, then a writer for each of
    ``manifest``'s shards into ``writers``, one by one: if an open fails, those open are there to discard."""
    for i in index:
        ckpt.reader(i)
    for name, shard in zip(names, manifest.shards):
        writers.append(dst.open_writer(f"{prefix}/{name}", size_hint=shard.size))


def _write_plain(ckpt: OpenCheckpoint, index: Sequence[int], manifest: Manifest, writers: Sequence[BlobWriter],
                 pool: Executor, nbuffers: int, where: str, advance: Callable[[int], None]) -> None:  # fmt: skip
    """Copy every chunk of ``manifest`` (shard k read from the source's shard ``index[k]``), each checked
    against its CRC-32C before it is written, then finish every shard."""

    def transfer(chunk: _Chunk, view: memoryview) -> None:
        ckpt.reader(index[chunk.shard]).read_into(chunk.offset, view)
        _check(view, chunk, manifest, where)
        writers[chunk.shard].write_at(chunk.offset, view)
        advance(chunk.length)

    # a chunk that fails (a bad source checksum) is never written: writes waiting for it in an upload window end
    _Pump(pool, nbuffers, manifest.chunk_bytes, functools.partial(interrupt, list(writers))).run(
        _chunks(manifest), transfer
    )
    for writer, shard in zip(writers, manifest.shards):
        writer.finish(shard.size)


def _discard(writers: Iterable[BlobWriter]) -> None:
    for writer in writers:
        try:
            writer.abort()
        except Exception:
            log.warning("could not discard %s after a failed copy", writer.key, exc_info=True)


def _existing(dst: Storage, step: int) -> Manifest | None:
    if not dst.exists(f"{step_dirname(step)}/{MANIFEST_NAME}"):
        return None
    return Catalog(dst).manifest(step)


def _check(view: memoryview, chunk: _Chunk, manifest: Manifest, where: str) -> None:
    actual = crc32c_hex(view)
    if actual != chunk.crc:
        file = manifest.shards[chunk.shard].file
        raise CorruptCheckpointError(
            f"checksum mismatch in {where}, step {manifest.step}, file {file}, tensor {chunk.tensor!r}, "
            f"chunk {chunk.index} (bytes {chunk.offset}..{chunk.offset + chunk.length}): "
            f"expected {chunk.crc}, got {actual}",
            step=manifest.step,
            file=file,
            tensor=chunk.tensor,
        )


def _read_back(
    dst: Storage,
    prefix: str,
    names: Sequence[str],
    manifest: Manifest,
    where: str,
    pool: Executor,
    nbuffers: int,
    advance: Callable[[int], None],
) -> None:
    readers: list[BlobReader] = []
    try:
        for name, shard in zip(names, manifest.shards):
            reader = dst.open_reader(f"{prefix}/{name}")
            if shard.encoding is not None:
                reader = DecodingReader(reader, shard.encoding, where=where, step=manifest.step, file=name)
            readers.append(reader)
            if reader.size != shard.size:
                raise CorruptCheckpointError(
                    f"{where}: shard {name} is {reader.size} bytes after the copy, expected {shard.size}",
                    step=manifest.step,
                    file=name,
                )

        def verify(chunk: _Chunk, view: memoryview) -> None:
            readers[chunk.shard].read_into(chunk.offset, view)
            _check(view, chunk, manifest, f"{where} (read back)")
            advance(chunk.length)

        _Pump(pool, nbuffers, manifest.chunk_bytes).run(_chunks(manifest), verify)
    finally:
        for reader in readers:
            reader.close()


def _write_encoded(
    source: Callable[[int], BlobReader],
    manifest: Manifest,
    writers: Sequence[BlobWriter],
    pool: Executor,
    window: int,
    where: str,
    advance: Callable[[int], None],
) -> list[Encoding]:
    """Write every shard compressed: ``window`` frames are read, checked and compressed on the pool while
    this thread writes the finished ones in order (a frame's stored offset is known only once the frames
    before it are compressed). Returns each shard's encoding."""
    chunks: dict[int, list[_Chunk]] = {}
    for c in _chunks(manifest):
        chunks.setdefault(c.shard, []).append(c)
    starts = {shard: [c.offset for c in cs] for shard, cs in chunks.items()}

    def encode(shard: int, offset: int, length: int, planes: int) -> tuple[bytes, Frame, int]:
        view = memoryview(bytearray(length))
        source(shard).read_into(offset, view)
        checked = 0
        first = bisect_left(starts.get(shard, []), offset)
        for chunk in chunks.get(shard, [])[first:]:
            if chunk.offset >= offset + length:
                break
            _check(view[chunk.offset - offset : chunk.offset - offset + chunk.length], chunk, manifest, where)
            checked += chunk.length
        stored, frame = encode_frame(view, planes)
        return stored, frame, checked

    frames: list[list[Frame]] = [[] for _ in manifest.shards]
    written = [0] * len(manifest.shards)
    pending: deque[tuple[int, Future[tuple[bytes, Frame, int]]]] = deque()

    def drain_one() -> None:
        shard, future = pending.popleft()
        stored, frame, checked = future.result()
        writers[shard].write_at(written[shard], memoryview(stored))
        written[shard] += len(stored)
        frames[shard].append(frame)
        advance(checked)

    try:
        for shard in range(len(manifest.shards)):
            for offset, length, planes in plan_frames(manifest, shard):
                if len(pending) >= window:
                    drain_one()
                pending.append((shard, pool.submit(encode, shard, offset, length, planes)))
        while pending:
            drain_one()
    except BaseException:
        for _, future in pending:
            future.cancel()
        wait([f for _, f in pending])
        raise
    for shard, writer in enumerate(writers):
        writer.finish(written[shard])
    return [Encoding("zstd", tuple(f)) for f in frames]


def copy_checkpoints(
    src: Storage,
    dst: Storage,
    steps: Sequence[int] | None = None,
    *,
    if_exists: Literal["error", "skip"] = "skip",
    read_back: bool = False,
    io_threads: int | None = None,
    buffer_bytes: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    compress: str | None = None,
) -> list[CopyResult]:
    """Copy several committed checkpoints (default: all of ``src``), oldest first, sharing one pool.

    Args:
        steps: the steps to copy; None copies every committed step of ``src``.
        progress: called with ``(step, bytes_done, bytes_total)``.
        Others: as :func:`copy_checkpoint`.

    Stops at the first failure and raises it; checkpoints copied before it stay committed.
    """
    chosen = sorted(Catalog(src).steps() if steps is None else steps)
    threads = io_threads if io_threads is not None else knobs.io_threads()
    results = []
    with ThreadPoolExecutor(threads, thread_name_prefix="tiersave-copy") as pool:
        for step in chosen:
            report = functools.partial(progress, step) if progress is not None else None
            results.append(
                copy_checkpoint(
                    src,
                    dst,
                    step,
                    if_exists=if_exists,
                    read_back=read_back,
                    io_threads=threads,
                    buffer_bytes=buffer_bytes,
                    executor=pool,
                    progress=report,
                    compress=compress,
                )
            )
    return results
