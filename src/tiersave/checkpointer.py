"""``Checkpointer``: save a training state as a checkpoint and restore it, atomically and verified.

Scope: the user-facing API and the orchestration of one save (flatten -> write -> commit -> retention)
and one restore (choose a step -> plan destinations -> read and verify -> load into the live state).
Anti-scope: byte layout (format/), file-system details (storage/), chunked parallel I/O (engine/).

Example::

    ckpt = tiersave.Checkpointer("/checkpoints/run1")
    state = {"model": model, "optim": optim, "sched": sched, "rng": tiersave.RNGState(), "step": 0}
    if ckpt.latest() is not None:
        ckpt.restore(into=state)            # in place; returns `state`
    for step in range(state["step"], steps):
        ...
        state["step"] = step + 1
        if step % 100 == 0:
            ckpt.save(step + 1, state, metrics={"loss": loss})
"""

from __future__ import annotations

import builtins
import logging
import time
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import knobs
from .catalog import Catalog, CheckpointInfo, OpenCheckpoint, VerifyReport
from .commit import RenameCommit
from .engine.reader import ReadRequest
from .engine.writer import TensorSource, plan_layout, write_shards
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    ObjectNotFoundError,
    SaveError,
    StateMismatchError,
    TiersaveError,
    TiersaveWarning,
)
from .format.jsonsafe import check_depth, dumps_canonical, is_finite_number
from .format.layout import MAX_CHUNK_BYTES, MAX_STEP, is_valid_tag, shard_filename
from .format.manifest import Manifest, ShardInfo, TensorEntry
from .handle import SaveHandle
from .state import (
    apply_into,
    as_bits,
    decode_placeholders,
    fill_tree,
    fits,
    flatten,
    match_targets,
    ndarray_byte_view,
    readable_in_place,
    tensor_byte_view,
    torch_dtype,
)
from .storage import open_storage
from .storage.base import Storage

log = logging.getLogger(__name__)

__all__ = ["Checkpointer", "RestoreReport"]


@dataclass
class RestoreReport:
    """What the last ``restore()`` did.

    Attributes:
        step: the step restored.
        location: URI of the checkpoint read.
        bytes_read: tensor bytes read and verified.
        seconds: wall time of the restore.
        in_place: tensors read directly into the live state's memory.
        skipped: ``(step, reason)`` for each newer checkpoint that could not be used.
    """

    step: int
    location: str
    bytes_read: int
    seconds: float
    in_place: int
    skipped: list[tuple[int, str]] = field(default_factory=list)


class Checkpointer:
    """Saves and restores checkpoints under one root.

    Args:
        root: a directory path or ``file://`` URI (created if missing), or a ``Storage``.
        keep_last: after each successful save, keep only this many newest checkpoints (None: keep all).
        io_threads: parallel readers/writers (default ``TIERSAVE_IO_THREADS`` or 2 x cores, at most 8).
        chunk_bytes: checksum/I/O chunk, a multiple of 4096 up to 64 MiB (default ``TIERSAVE_CHUNK_BYTES``).
        max_shard_bytes: start a new shard file past this many bytes (None: one shard).

    Thread safety: one thread calls ``save``/``restore`` at a time; listing methods may be called from
    any thread. Use as a context manager or call ``close()``.
    """

    def __init__(
        self,
        root: str | Any,
        *,
        keep_last: int | None = None,
        io_threads: int | None = None,
        chunk_bytes: int | None = None,
        max_shard_bytes: int | None = None,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        threads = io_threads if io_threads is not None else knobs.io_threads()
        if not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"io_threads must be a positive integer, got {threads!r}")
        chunk = chunk_bytes if chunk_bytes is not None else knobs.chunk_bytes()
        if not isinstance(chunk, int) or chunk < 4096 or chunk > MAX_CHUNK_BYTES or chunk % 4096:
            raise ConfigError(f"chunk_bytes must be a multiple of 4096 in [4096, {MAX_CHUNK_BYTES}], got {chunk!r}")
        if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int) or max_shard_bytes < 4096):
            raise ConfigError(f"max_shard_bytes must be >= 4096 or None, got {max_shard_bytes!r}")
        self.storage: Storage = open_storage(root)
        self.catalog = Catalog(self.storage)
        self.keep_last = keep_last
        self.chunk_bytes = chunk
        self.max_shard_bytes = max_shard_bytes
        self._commit = RenameCommit(self.storage)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tiersave-io")
        self._last: SaveHandle | None = None
        self._closed = False
        self.last_restore: RestoreReport | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the I/O threads. Idempotent."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({self.storage.uri!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Checkpointer is closed")

    # -- listing ----------------------------------------------------------------------------------

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints with valid manifests, oldest first."""
        return self.catalog.infos()

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint with a valid manifest, or None."""
        for step in reversed(self.catalog.steps()):
            try:
                return self.catalog.info(step)
            except (FormatError, CheckpointNotFoundError):
                continue
        return None

    def info(self, step: int) -> CheckpointInfo:
        return self.catalog.info(step)

    def verify(self, step: int | None = None) -> VerifyReport:
        """Read every byte of a checkpoint (default: the newest) and check it against its checksums."""
        if step is None:
            steps = self.catalog.steps()
            if not steps:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.storage.uri}")
            step = steps[-1]
        return self.catalog.verify(step, executor=self._pool)

    def prune(self, keep_last: int) -> builtins.list[int]:
        """Delete all but the ``keep_last`` newest checkpoints and the leftovers of interrupted saves.

        Returns:
            The deleted steps.
        """
        if not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last must be a positive integer, got {keep_last!r}")
        return self.catalog.prune(keep_last).deleted

    # -- save -------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, float] | None = None,
        tags: Iterable[str] = (),
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Save ``state`` as the checkpoint of ``step`` and return once it is committed and durable.

        Args:
            step: a non-negative integer; a step that is already committed is never overwritten.
            state: the state tree (see :mod:`tiersave.state` for what it may hold).
            metrics: finite numbers recorded in the manifest (used by keep-best retention).
            tags: names such as ``"best"`` or ``"milestone"`` to find the checkpoint by later.
            metadata: free JSON-serializable data recorded in the manifest.

        Returns:
            A completed :class:`SaveHandle`; ``handle.result()`` is the checkpoint's info.

        Raises:
            ConfigError: a bad step, metric, tag or metadata value.
            UnsupportedStateError: the state holds an object that cannot be saved.
            AlreadyExistsError: ``step`` is already committed.
            StorageError: the write failed (out of space, permission...); nothing became visible.
            SaveError: an earlier save failed and its error was never observed.
        """
        self._check_open()
        self._raise_unobserved()
        step, metrics_d, tags_t, metadata_d = _validate_save_args(step, metrics, tags, metadata)
        handle = SaveHandle(step)
        self._last = handle
        t0 = time.perf_counter()
        flat = flatten(state)
        t_flat = time.perf_counter()
        prefix = self._commit.begin(step)
        try:
            sources = [TensorSource(t.name, t.nbytes, t.cpu_bytes) for t in flat.tensors]
            layout = plan_layout(sources, lambda i: shard_filename(0, i), max_shard_bytes=self.max_shard_bytes)
            written = write_shards(self.storage, prefix, layout, chunk_bytes=self.chunk_bytes, executor=self._pool)
            handle._set_staged()  # synchronous: the bytes are on storage, the caller may mutate
            by_name = {t.name: t for t in flat.tensors}
            tensors = {}
            for index, shard in enumerate(layout):
                for placed in shard.tensors:
                    ft = by_name[placed.source.name]
                    tensors[ft.name] = TensorEntry(
                        ft.name,
                        ft.dtype,
                        ft.shape,
                        index,
                        placed.offset,
                        ft.nbytes,
                        written.checksums[ft.name],
                    )
            stats = handle.stats
            stats.flatten_s = t_flat - t0
            stats.write_s = written.seconds
            stats.tensor_bytes = flat.nbytes
            stats.stored_bytes = written.bytes_written
            stats.num_tensors = len(flat.tensors)
            stats.total_s = stats.blocked_s = time.perf_counter() - t0  # up to the commit
            manifest = Manifest(
                step=step,
                shards=tuple(ShardInfo(s.file, 0, s.size) for s in layout),
                tensors=tensors,
                tree=flat.tree,
                chunk_bytes=self.chunk_bytes,
                metrics=metrics_d,
                tags=tags_t,
                metadata=metadata_d,
                stats=stats.to_json(),
            )
            t_commit = time.perf_counter()
            self._commit.commit(prefix, step, manifest.to_json())
            stats.commit_s = time.perf_counter() - t_commit
        except BaseException as exc:
            self._abort(prefix)
            handle._set_error(exc)
            handle._observed = True  # raised right here, to the caller
            raise
        stats.total_s = stats.blocked_s = time.perf_counter() - t0
        info = self.catalog.remember(manifest)  # committed: describe it from memory, no read-back
        handle._set_result(info)
        if self.keep_last is not None:
            self._retain(self.keep_last)
        return handle

    def _abort(self, prefix: str) -> None:
        try:
            self._commit.abort(prefix)
        except Exception:  # keep the original error; prune removes what is left
            log.warning("could not remove %s after a failed save", prefix, exc_info=True)

    def _retain(self, keep_last: int) -> None:
        try:
            self.prune(keep_last)
        except TiersaveError as exc:
            warnings.warn(f"retention after save failed: {exc}", TiersaveWarning, stacklevel=3)

    def _raise_unobserved(self) -> None:
        last = self._last
        if last is None:
            return
        err = last._unobserved_error()
        if err is not None:
            last._observed = True
            raise SaveError(f"the save of step {last.step} failed and nobody observed it: {err}") from err

    # -- restore ----------------------------------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        *,
        tag: str | None = None,
        into: Any = None,
        strict: bool = True,
    ) -> Any:
        """Restore a checkpoint and return the state.

        With ``into``, tensors are read straight into the live tensors' memory where dtype, shape and
        device allow (no extra full copy), stateful objects get ``load_state_dict``, and dicts/lists are
        updated in place; ``into`` itself is returned. Without it, a new tree of CPU tensors is returned.

        Args:
            step: the step to restore; None means the newest. When None, a checkpoint that fails to read
                or verify is reported (``TiersaveWarning``) and the next older one is tried.
            tag: restore the newest checkpoint carrying this tag.
            into: the live state to load into (same structure as saved).
            strict: with ``into``, fail when ``into`` has keys the checkpoint lacks.

        Raises:
            CheckpointNotFoundError: no committed checkpoint matches.
            CorruptCheckpointError / FormatError: the requested (or every) checkpoint failed to verify.
            StateMismatchError: the live state cannot hold the checkpoint.

        If reading fails midway, tensors in ``into`` may hold partial data; no ``load_state_dict`` or
        dict update happens unless every byte verified.
        """
        self._check_open()
        start = time.perf_counter()
        candidates = self.catalog.find(step, tag)
        if not candidates:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.storage.uri}")
        skipped: list[tuple[int, str]] = []
        last_error: TiersaveError | None = None
        for candidate in candidates:
            try:
                result, nbytes, in_place = self._restore_one(candidate, into, strict)
            except (FormatError, CheckpointNotFoundError, ObjectNotFoundError) as exc:
                if step is not None:
                    raise
                last_error = exc
                skipped.append((candidate, str(exc)))
                warnings.warn(
                    f"skipping checkpoint of step {candidate} in {self.storage.uri}: {exc}",
                    TiersaveWarning,
                    stacklevel=2,
                )
                continue
            self.last_restore = RestoreReport(
                candidate,
                self.catalog.location(candidate),
                nbytes,
                time.perf_counter() - start,
                in_place,
                skipped,
            )
            return result
        raise CorruptCheckpointError(
            f"no usable checkpoint in {self.storage.uri}: every candidate failed "
            + "; ".join(f"step {s}: {why}" for s, why in skipped)
        ) from last_error

    def _restore_one(self, step: int, into: Any, strict: bool) -> tuple[Any, int, int]:
        with self.catalog.open(step) as ckpt:
            return _Restore(ckpt, into, strict).run(self._pool)


class _Restore:
    """One restore of one checkpoint: choose destinations, read, copy, rebuild."""

    def __init__(self, ckpt: OpenCheckpoint, into: Any, strict: bool) -> None:
        self.ckpt = ckpt
        self.into = into
        self.strict = strict

    def run(self, pool: ThreadPoolExecutor) -> tuple[Any, int, int]:
        manifest = self.ckpt.manifest
        saved = decode_placeholders(manifest.tree)
        targets = match_targets(saved, self.into, strict=self.strict) if self.into is not None else {}
        requests: list[ReadRequest] = []
        dests: dict[str, torch.Tensor | np.ndarray] = {}
        claimed: list[tuple[int, int]] = []
        in_place = 0
        for name, entry in manifest.tensors.items():
            candidates = targets.get(name, [])
            for t in candidates:
                if t.strict and not fits(t.value, entry.dtype, entry.shape):
                    raise StateMismatchError(
                        f"{t.path}: the live value is {_describe(t.value)} but step {manifest.step} holds "
                        f"{entry.dtype}{list(entry.shape)}"
                    )
            dest: torch.Tensor | np.ndarray | None = None
            for t in candidates:
                if fits(t.value, entry.dtype, entry.shape) and readable_in_place(t.value):
                    span = _span(t.value)
                    if span[1] > span[0] and any(a < span[1] and span[0] < b for a, b in claimed):
                        continue  # memory already filled by another stored tensor (tied in the live model)
                    claimed.append(span)
                    dest = t.value
                    in_place += 1
                    break
            if dest is None:
                dest = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
            dests[name] = dest
            view = ndarray_byte_view(dest) if isinstance(dest, np.ndarray) else tensor_byte_view(dest)
            requests.append(ReadRequest(entry, view))
        self.ckpt.read(requests, executor=pool)
        values: dict[str, Any] = {}
        for name, entry in manifest.tensors.items():
            dest = dests[name]
            primary: Any = dest
            for t in targets.get(name, []):
                if t.value is dest or not fits(t.value, entry.dtype, entry.shape):
                    continue
                _copy_into(t.value, dest)
                if primary is dest:
                    primary = t.value
            values[name] = primary
        if any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values.values()):
            torch.cuda.synchronize()
        result = fill_tree(saved, values) if self.into is None else apply_into(saved, self.into, values)
        return result, manifest.total_bytes, in_place


def _span(value: torch.Tensor | np.ndarray) -> tuple[int, int]:
    if isinstance(value, np.ndarray):
        start = int(value.__array_interface__["data"][0])
        return start, start + value.nbytes
    start = value.data_ptr()
    return start, start + value.numel() * value.element_size()


def _copy_into(target: torch.Tensor | np.ndarray, src: torch.Tensor | np.ndarray) -> None:
    if isinstance(target, np.ndarray):
        np.copyto(target, src.numpy() if isinstance(src, torch.Tensor) else src)
        return
    source = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    with torch.no_grad():
        as_bits(target).copy_(as_bits(source), non_blocking=target.device.type == "cuda")


def _describe(value: torch.Tensor | np.ndarray) -> str:
    if isinstance(value, np.ndarray):
        return f"numpy {value.dtype}{list(value.shape)}"
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)} on {value.device}"


def _validate_save_args(
    step: Any, metrics: Mapping[str, float] | None, tags: Iterable[str], metadata: Mapping[str, Any] | None
) -> tuple[int, dict[str, float], tuple[str, ...], dict[str, Any]]:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= int(step) <= MAX_STEP:
        raise ConfigError(f"step must be an integer in [0, 2**63), got {step!r}")
    metrics_d: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, np.generic):
            value = value.item()
        if not isinstance(key, str) or not is_finite_number(value):
            raise ConfigError(f"metric {key!r} must be a finite number, got {value!r}")
        metrics_d[key] = value if isinstance(value, int) else float(value)
    if isinstance(tags, str):
        tags = (tags,)
    tags_t = tuple(dict.fromkeys(tags))
    for tag in tags_t:
        if not isinstance(tag, str) or not is_valid_tag(tag):
            raise ConfigError(f"tag {tag!r} must match [A-Za-z0-9][A-Za-z0-9._-]* (at most 64 characters)")
    metadata_d = dict(metadata or {})
    try:
        dumps_canonical(metadata_d)
        check_depth(metadata_d, what="metadata", limit=64)
    except (TypeError, ValueError, FormatError) as exc:
        raise ConfigError(f"metadata must be plain JSON (dicts, lists, strings, finite numbers): {exc}") from None
    if not all(isinstance(k, str) for k in metadata_d):
        raise ConfigError("metadata keys must be strings")
    return int(step), metrics_d, tags_t, metadata_d
