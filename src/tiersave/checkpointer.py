"""``Checkpointer``: save a training state as a checkpoint and restore it, atomically and verified.

Scope: the user-facing API and the orchestration of a save (flatten -> stage -> write -> commit ->
retention) and of a restore (choose a step -> read and verify -> load into the live state).
Anti-scope: byte layout (format/), file-system details (storage/), chunked parallel I/O (engine/),
staging memory (stage.py), restore planning (restore.py).

A save has two moments. It is *staged* when the state's bytes are in the staging arena: ``save(...,
blocking=False)`` (alias ``save_async``) returns then, and training may change its tensors. It is
*durable* when the checkpoint is committed: ``save()`` (blocking, the default) returns then, and
``handle.result()`` returns its info. Background work (writes, fsync, commit, retention) runs on daemon
threads while training goes on; one save is in flight at a time, and ``on_busy`` says what a new save
does when the previous one is still being written.

Example::

    ckpt = tiersave.Checkpointer("/checkpoints/run1", keep_last=3)
    state = {"model": model, "optim": optim, "sched": sched, "rng": tiersave.RNGState(), "step": 0}
    if ckpt.latest() is not None:
        ckpt.restore(into=state)            # in place; returns `state`
    for step in range(state["step"] + 1, steps + 1):
        ...
        state["step"] = step
        if step % 100 == 0:
            ckpt.save_async(step, state, metrics={"loss": loss})   # blocks only for the copy
    ckpt.close()                            # waits for the last save
"""

from __future__ import annotations

import builtins
import logging
import math
import os
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from . import _lifecycle, knobs
from .catalog import CheckpointInfo, VerifyReport
from .engine.copy import copy_checkpoint
from .engine.pipeline import StagedWrite, plan_save
from .engine.pool import DaemonThreadPool
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    SaveError,
    StorageError,
    TiersaveError,
    TiersaveWarning,
)
from .events import EVENTS_NAME, EventLog
from .format.jsonsafe import check_depth, dumps_canonical, is_finite_number
from .format.layout import MAX_CHUNK_BYTES, MAX_STEP, align_up, is_valid_tag, shard_filename
from .format.manifest import Manifest, ShardInfo, TensorEntry
from .handle import SaveHandle
from .planner.schedule import SaveCost, Schedule, parse_schedule
from .policy import RetentionPolicy
from .restore import Restore
from .stage import HostCopier, StagingArena, needs_pinned
from .state import flatten
from .storage.base import Storage
from .tiers import Protection, Tier, TierRuntime, check_chain, to_policy

log = logging.getLogger(__name__)

__all__ = ["Checkpointer", "RestoreReport"]

OnBusy = Literal["wait", "skip", "raise"]


@dataclass
class RestoreReport:
    """What the last ``restore()`` did.

    Attributes:
        step: the step restored.
        location: URI of the checkpoint read.
        bytes_read: tensor bytes read and verified.
        seconds: wall time of the restore.
        in_place: tensors read directly into the live state's memory.
        skipped: ``(step, reason)`` for each copy (newer, or in a faster tier) that could not be used.
        tier: the name of the tier it was read from.
    """

    step: int
    location: str
    bytes_read: int
    seconds: float
    in_place: int
    skipped: list[tuple[int, str]] = field(default_factory=list)
    tier: str = ""


@dataclass
class _Pending:
    """A save between staging and commit, handed from the caller's thread to the commit thread."""

    handle: SaveHandle
    job: StagedWrite
    prefix: str
    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    tree: Any
    metrics: dict[str, float]
    tags: tuple[str, ...]
    metadata: dict[str, Any]
    started: float
    started_wall: float


class Checkpointer:
    """Saves and restores checkpoints under one root.

    Args:
        root: a directory path or ``file://`` URI (created if missing), or a ``Storage``.
        keep_last: after each successful save, keep only this many newest checkpoints (None: keep all).
        io_threads: parallel readers/writers (default ``TIERSAVE_IO_THREADS`` or 2 x cores, at most 8).
        chunk_bytes: checksum/I/O chunk, a multiple of 4096 up to 64 MiB (default ``TIERSAVE_CHUNK_BYTES``).
        max_shard_bytes: start a new shard file past this many bytes (None: one shard).
        staging_bytes: host memory for staging (None: one copy of the state, at most half the available
            memory, or ``TIERSAVE_STAGING_BYTES``). A larger state streams through it.
        on_busy: when a save is requested while the previous one is still being written: ``"wait"`` for
            it, ``"skip"`` this save (a warning, ``skipped_saves`` counts them), or ``"raise"`` SaveError.
        schedule: when to save, for loops that ask ``due(step)``: steps (int), seconds (float),
            ``"steps:100"``, ``"seconds:10min"``, ``"auto:mttf=4h"`` or a ``Schedule`` object.
        exit_timeout_s: how long interpreter exit, SIGTERM or ``close()`` wait for an in-flight save.
        handle_sigterm: on SIGTERM, finish (or report) the in-flight save before the process ends.
        event_log: append every save's timings to ``ROOT/tiersave-events.jsonl`` (local roots).

    Thread safety: one thread calls ``save``/``restore`` at a time; listing methods may be called from
    any thread. Use as a context manager or call ``close()``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage | None = None,
        *,
        tiers: Sequence[Tier | str | os.PathLike[str] | Storage] | None = None,
        keep_last: int | None = None,
        io_threads: int | None = None,
        chunk_bytes: int | None = None,
        max_shard_bytes: int | None = None,
        staging_bytes: int | None = None,
        on_busy: OnBusy = "wait",
        schedule: Schedule | str | int | float | None = None,
        exit_timeout_s: float = 300.0,
        handle_sigterm: bool = True,
        event_log: bool = True,
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
        if on_busy not in ("wait", "skip", "raise"):
            raise ConfigError(f"on_busy must be 'wait', 'skip' or 'raise', got {on_busy!r}")
        if not exit_timeout_s >= 0:
            raise ConfigError(f"exit_timeout_s must be >= 0, got {exit_timeout_s!r}")
        self._schedule = parse_schedule(schedule)
        if (root is None) == (tiers is None):
            raise ConfigError("give either a root (one tier) or tiers=[...], not both and not neither")
        chain: Sequence[Tier | str | os.PathLike[str] | Storage] = [root] if root is not None else (tiers or [])
        specs = [t if isinstance(t, Tier) else Tier(t) for t in chain]
        self._tiers: list[TierRuntime] = []
        try:
            for index, spec in enumerate(specs):
                self._tiers.append(TierRuntime(spec, index, default_keep=keep_last, io_threads=threads))
            check_chain(self._tiers)
        except BaseException:
            for built in self._tiers:
                built.shutdown(wait=False)
            raise
        first = self._tiers[0]
        self.storage: Storage = first.storage
        self.catalog = first.catalog
        self._commit = first.commit
        self._protection = Protection()
        self.keep_last = keep_last
        self.chunk_bytes = chunk
        self.max_shard_bytes = max_shard_bytes
        self.on_busy: OnBusy = on_busy
        self.exit_timeout_s = float(exit_timeout_s)
        self._arena = StagingArena(staging_bytes)
        self._copier = HostCopier()
        self._pool = DaemonThreadPool(threads, "tiersave-io")
        self._committer = DaemonThreadPool(1, "tiersave-commit")
        self.events = _event_log(self._tiers) if event_log else None
        self._lock = threading.Lock()
        self._last: SaveHandle | None = None
        self._inflight: SaveHandle | None = None
        self._staging_step: int | None = None
        self._last_drain_s = 0.0
        self._last_commit_mono: float | None = None
        self._save_period_s: float | None = None
        self._closed = False
        self.skipped_saves = 0
        self.last_restore: RestoreReport | None = None
        _lifecycle.register(self, handle_sigterm=handle_sigterm)

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight save (up to ``timeout``, default ``exit_timeout_s``), then release the
        threads and the staging memory. Idempotent.

        Returns:
            True if no save was left unfinished. An unfinished save is reported as a warning; it is not
            visible (the previous checkpoint stays the newest).

        Raises:
            SaveError: the last save failed in the background and nobody observed its error.
        """
        if self._closed:
            return True
        finished = self.wait(timeout if timeout is not None else self.exit_timeout_s, raise_errors=False)
        self._closed = True
        _lifecycle.unregister(self)
        self._committer.shutdown(wait=finished)
        self._pool.shutdown(wait=finished)
        for tier in self._tiers:
            tier.shutdown(wait=finished)
        self._copier.close()
        if finished:
            self._arena.release()
            self._raise_unobserved()
        else:
            pending = self._inflight
            warnings.warn(
                f"tiersave: the save of step {pending.step if pending else '?'} did not finish before close; "
                f"it is not visible, the newest checkpoint in {self.storage.uri} is the previous one",
                TiersaveWarning,
                stacklevel=2,
            )
        return finished

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already propagating: report a failed save, don't replace that exception
            self.close()
        except SaveError as err:
            warnings.warn(str(err), TiersaveWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"Checkpointer({self.storage.uri!r})"

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Checkpointer is closed")

    def wait(self, timeout: float | None = None, *, raise_errors: bool = True) -> bool:
        """Wait until no save is in flight and its follow-up work (drains to later tiers, retention) is done.

        Returns:
            False if ``timeout`` seconds passed first.

        Raises:
            TiersaveError: the last save failed (when ``raise_errors``); the error counts as observed.
        """
        pending = self._inflight
        if pending is None:
            return True
        if not pending.wait(timeout):
            return False
        # The commit thread runs its queue in order: once a no-op queued now has run, retention and
        # every other follow-up of the saves before it have run too.
        from concurrent.futures import TimeoutError as FutureTimeout

        deadline = None if timeout is None else time.monotonic() + timeout
        for pool in [self._committer, *(t.drainer for t in self._tiers if t.drainer is not None)]:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                pool.submit(lambda: None).result(remaining)
            except FutureTimeout:
                return False
            except RuntimeError:  # the pool is already shut down: nothing can be pending
                pass
        if raise_errors:
            err = pending.exception()
            if err is not None:
                raise err
        return True

    def _exit_hook(self, reason: str) -> None:
        """Called at interpreter exit or on SIGTERM: finish the in-flight save or say it did not finish."""
        if self._closed:
            return
        import sys

        pending = self._inflight
        if self._staging_step is not None:
            sys.stderr.write(
                f"tiersave: {reason} while staging step {self._staging_step}; that save is abandoned and not "
                f"visible (the newest checkpoint in {self.storage.uri} is unchanged)\n"
            )
            return
        if pending is not None and not pending.done():
            sys.stderr.write(
                f"tiersave: {reason}: finishing the save of step {pending.step} (up to {self.exit_timeout_s:.0f} s)\n"
            )
        if not self.wait(self.exit_timeout_s, raise_errors=False):
            sys.stderr.write(
                f"tiersave: the save of step {pending.step if pending else '?'} did not finish within "
                f"{self.exit_timeout_s:.0f} s; it is not visible (the newest checkpoint is the previous one)\n"
            )
            return
        if pending is not None and pending._unobserved_error() is not None:
            sys.stderr.write(f"tiersave: the save of step {pending.step} FAILED: {pending.exception()}\n")

    # -- listing ----------------------------------------------------------------------------------

    @property
    def tiers(self) -> builtins.list[str]:
        """Names of the tiers, fastest first."""
        return [t.name for t in self._tiers]

    def _tier(self, name: str | None) -> TierRuntime:
        if name is None:
            return self._tiers[0]
        for tier in self._tiers:
            if tier.name == name:
                return tier
        raise ConfigError(f"no tier named {name!r}; tiers: {', '.join(self.tiers)}")

    def _holdings(self) -> dict[int, builtins.list[TierRuntime]]:
        """Committed step -> the tiers holding it, fastest first."""
        out: dict[int, builtins.list[TierRuntime]] = {}
        for tier in self._tiers:
            for step in tier.catalog.steps():
                out.setdefault(step, []).append(tier)
        return out

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints with valid manifests, oldest first, each with the tiers that hold it.

        The info describes the copy in the fastest tier holding the step.
        """
        out = []
        for step, holders in sorted(self._holdings().items()):
            for tier in holders:
                try:
                    info = tier.catalog.info(step)
                except (FormatError, CheckpointNotFoundError):
                    continue
                out.append(replace(info, tiers=tuple(t.name for t in holders)))
                break
        return out

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint with a valid manifest in any tier, or None."""
        for step, holders in sorted(self._holdings().items(), reverse=True):
            for tier in holders:
                try:
                    return replace(tier.catalog.info(step), tiers=tuple(t.name for t in holders))
                except (FormatError, CheckpointNotFoundError):
                    continue
        return None

    def info(self, step: int, *, tier: str | None = None) -> CheckpointInfo:
        """The info of ``step`` on ``tier`` (default: the fastest tier holding it)."""
        holders = self._holdings().get(step, [])
        if tier is not None:
            holders = [t for t in holders if t.name == self._tier(tier).name]
        if not holders:
            where = f"tier {tier!r}" if tier is not None else ", ".join(t.storage.uri for t in self._tiers)
            raise CheckpointNotFoundError(f"no checkpoint of step {step} in {where}")
        return replace(holders[0].catalog.info(step), tiers=tuple(t.name for t in self._holdings()[step]))

    def verify(self, step: int | None = None, *, tier: str | None = None) -> VerifyReport:
        """Read every byte of a checkpoint (default: the newest) on ``tier`` (default: the first) and check
        it against its checksums."""
        runtime = self._tier(tier)
        if step is None:
            steps = runtime.catalog.steps()
            if not steps:
                raise CheckpointNotFoundError(f"no committed checkpoint in {runtime.storage.uri}")
            step = steps[-1]
        return runtime.catalog.verify(step, executor=self._pool)

    def prune(
        self, keep_last: int | None = None, *, policy: RetentionPolicy | str | None = None, tier: str | None = None
    ) -> builtins.list[int]:
        """Apply retention now: keep the ``keep_last`` newest (or what ``policy`` keeps) on ``tier`` (default:
        every tier), never a checkpoint being read or drained, nor a tier's newest; also remove the
        leftovers of interrupted saves.

        Returns:
            The deleted steps (of every tier pruned).
        """
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last must be a positive integer, got {keep_last!r}")
        if (keep_last is None) == (policy is None):
            raise ConfigError("give prune() either keep_last or policy")
        chosen = to_policy(keep_last if policy is None else policy)
        deleted: builtins.list[int] = []
        for runtime in [self._tier(tier)] if tier is not None else self._tiers:
            deleted.extend(self._retain(runtime, chosen, warn=False))
            if runtime.storage.capabilities.atomic_rename:
                runtime.catalog.clean_leftovers()
        return sorted(set(deleted))

    def prepare(self, state: Any) -> None:
        """Do now, before training starts, the one-time work the first save would otherwise pay: allocate
        (and fault in) the staging memory for ``state``, and calibrate the I/O policy of local tiers.

        Optional: without it the first save is slower than the rest (about 1.5 s per GB of state here).
        """
        self._check_open()
        flat = flatten(state)
        padded = sum(align_up(t.nbytes) for t in flat.tensors)
        chunk = self._chunk_for(padded)
        self._arena.reserve(
            padded, pinned=needs_pinned([t.source for t in flat.tensors]), min_bytes=min(2 * chunk, padded)
        )
        for tier in self._tiers:
            policy = getattr(tier.storage, "io_policy", None)
            if policy is not None:
                policy.ensure_calibrated()

    # -- scheduling -------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether the configured ``schedule`` says to save at ``step`` now."""
        if self._schedule is None:
            raise ConfigError("no schedule configured: pass Checkpointer(schedule=...)")
        return self._schedule.due(step, time.monotonic())

    @property
    def schedule(self) -> Schedule | None:
        return self._schedule

    # -- save -------------------------------------------------------------------------------------

    def save_async(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, float] | None = None,
        tags: Iterable[str] = (),
        metadata: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """``save(..., blocking=False)``: return once the state is staged; write in the background."""
        return self.save(step, state, metrics=metrics, tags=tags, metadata=metadata, blocking=False)

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, float] | None = None,
        tags: Iterable[str] = (),
        metadata: Mapping[str, Any] | None = None,
        blocking: bool = True,
    ) -> SaveHandle:
        """Save ``state`` as the checkpoint of ``step``.

        The call blocks while the state's bytes are copied into the staging arena (from the GPU with
        non-blocking copies on a side stream). With ``blocking=True`` it then waits until the checkpoint
        is committed and durable; with ``blocking=False`` it returns at once and the handle tells when
        the save is durable (``handle.result()``), re-raising any background error. Once this returns,
        changes to the state's tensors never leak into the checkpoint.

        Args:
            step: a non-negative integer; a step that is already committed is never overwritten.
            state: the state tree (see :mod:`tiersave.state` for what it may hold).
            metrics: finite numbers recorded in the manifest (used by keep-best retention).
            tags: names such as ``"best"`` or ``"milestone"`` to find the checkpoint by later.
            metadata: free JSON-serializable data recorded in the manifest.
            blocking: wait until the checkpoint is durable (default) or only until it is staged.

        Returns:
            A :class:`SaveHandle`. A save skipped by ``on_busy="skip"`` returns a handle with
            ``skipped=True`` whose ``result()`` is None.

        Raises:
            ConfigError: a bad step, metric, tag or metadata value.
            UnsupportedStateError: the state holds an object that cannot be saved.
            AlreadyExistsError: ``step`` is already committed.
            StorageError: the write failed (out of space, permission...); nothing became visible.
            SaveError: an earlier save failed and its error was never observed, or ``on_busy="raise"``
                and a save is in flight.
        """
        self._check_open()
        self._raise_unobserved()
        step, metrics_d, tags_t, metadata_d = _validate_save_args(step, metrics, tags, metadata)
        started, started_wall, started_mono = time.perf_counter(), time.time(), time.monotonic()
        previous = self._inflight
        if previous is not None and not previous.done():
            if self.on_busy == "skip":
                self.skipped_saves += 1
                warnings.warn(
                    f"skipping the save of step {step}: the save of step {previous.step} is still being written "
                    f"({self.skipped_saves} skipped so far)",
                    TiersaveWarning,
                    stacklevel=2,
                )
                self._log_event(
                    {
                        "step": step,
                        "outcome": "skipped",
                        "time": started_wall,
                        "reason": f"save of step {previous.step} in flight",
                    }
                )
                return SaveHandle.skipped_save(step)
            if self.on_busy == "raise":
                raise SaveError(f"the save of step {previous.step} is still being written (on_busy='raise')")
            previous.wait()
            self._raise_unobserved()
        handle = SaveHandle(step)
        with self._lock:
            self._last = handle
            self._inflight = handle
        pending = self._stage(handle, step, state, metrics_d, tags_t, metadata_d, started, started_wall, blocking)
        self._committer.submit(self._complete, pending)
        if self._schedule is not None:
            self._schedule.record(
                SaveCost(
                    step=step, blocked_s=handle.stats.blocked_s, drain_s=self._last_drain_s, wall_time=started_mono
                )
            )
        if blocking:
            handle.result()
            self._committer.submit(lambda: None).result()  # and the first tier's retention after it
        return handle

    def _stage(
        self,
        handle: SaveHandle,
        step: int,
        state: Any,
        metrics: dict[str, float],
        tags: tuple[str, ...],
        metadata: dict[str, Any],
        started: float,
        started_wall: float,
        blocking: bool = False,
    ) -> _Pending:
        """Caller's thread: flatten, lay out, stage. On failure nothing is visible and the error is raised."""
        stats = handle.stats
        prefix: str | None = None
        job: StagedWrite | None = None
        self._staging_step = step
        try:
            flat = flatten(state)
            t_flat = time.perf_counter()
            stats.flatten_s = t_flat - started
            plan = plan_save(
                [t.name for t in flat.tensors],
                [t.nbytes for t in flat.tensors],
                chunk_bytes=self._chunk_for(sum(align_up(t.nbytes) for t in flat.tensors)),
                shard_file=lambda i: shard_filename(0, i),
                max_shard_bytes=self.max_shard_bytes,
            )
            prefix = self._commit.begin(step)
            io_before = _io_bytes(self.storage)
            job = StagedWrite(
                self.storage, prefix, plan, [t.source for t in flat.tensors], self._arena, self._pool, self._copier
            )
            job.stage(overlap=blocking)  # async: shortest stall; blocking: shortest time to durable
        except BaseException as exc:
            if job is not None:
                job.abort()
            if prefix is not None:
                self._abort_prefix(prefix)
            handle._set_error(exc)
            handle._observed = True  # raised right here, to the caller
            self._log_event({"step": step, "outcome": "failed", "time": started_wall, "error": str(exc)})
            raise
        finally:
            self._staging_step = None
        if not job.pinned:
            handle._set_staged()  # CPU copies are done; device copies are confirmed by the commit thread
        stats.stage_s = job.stage_s
        stats.stage_wait_s = job.ring.waited_s
        stats.tensor_bytes = flat.nbytes
        stats.stored_bytes = plan.total_bytes
        stats.num_tensors = len(flat.tensors)
        stats.blocked_s = time.perf_counter() - started
        stats.extra["io_before"] = io_before
        return _Pending(
            handle,
            job,
            prefix,
            [t.name for t in flat.tensors],
            [t.dtype for t in flat.tensors],
            [t.shape for t in flat.tensors],
            flat.tree,
            metrics,
            tags,
            metadata,
            started,
            started_wall,
        )

    def _chunk_for(self, padded_bytes: int) -> int:
        """The chunk size for a save of ``padded_bytes`` (tensors padded to 4 KiB): the configured one,
        unless the state streams through a smaller staging budget; then at most half the budget, so
        staging and writing overlap."""
        budget = self._arena.budget_for(padded_bytes)
        if budget >= padded_bytes:
            return self.chunk_bytes
        return min(self.chunk_bytes, max(4096, (budget // 2) // 4096 * 4096))

    def _complete(self, p: _Pending) -> None:
        """Commit thread: wait for the writes, make them durable, commit; then drains and retention."""
        handle, stats = p.handle, p.handle.stats
        try:
            p.job.wait_staged()
            handle._set_staged()
            checksums = p.job.finish()
            stats.write_s = time.perf_counter() - p.started - stats.flatten_s
            before = stats.extra.pop("io_before", None)
            after = _io_bytes(self.storage)
            if before is not None and after is not None:  # bytes per I/O path (direct, buffered...)
                stats.extra["io"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
            plan = p.job.plan
            tensors = {}
            for i, name in enumerate(p.names):
                shard, offset = plan.offsets[name]
                tensors[name] = TensorEntry(
                    name, p.dtypes[i], p.shapes[i], shard, offset, plan.nbytes[i], checksums[name]
                )
            stats.total_s = time.perf_counter() - p.started
            manifest = Manifest(
                step=handle.step,
                shards=tuple(ShardInfo(self._commit.shard_file(p.prefix, s.file), 0, s.size) for s in plan.shards),
                tensors=tensors,
                tree=p.tree,
                chunk_bytes=plan.chunk_bytes,
                metrics=p.metrics,
                tags=p.tags,
                metadata=p.metadata,
                stats=stats.to_json(),
            )
            t_commit = time.perf_counter()
            self._commit.commit(p.prefix, handle.step, manifest.to_json())
            stats.commit_s = time.perf_counter() - t_commit
        except BaseException as exc:
            p.job.abort()
            self._abort_prefix(p.prefix)
            self._log_event(
                {"step": handle.step, "outcome": "failed", "time": p.started_wall, "error": str(exc), **stats.to_json()}
            )
            handle._set_error(exc)
            return
        stats.total_s = time.perf_counter() - p.started
        self._last_drain_s = stats.total_s
        now = time.monotonic()
        if self._last_commit_mono is not None:
            gap = now - self._last_commit_mono
            self._save_period_s = gap if self._save_period_s is None else 0.7 * self._save_period_s + 0.3 * gap
        self._last_commit_mono = now
        info = self.catalog.remember(manifest)
        self._log_event(
            {
                "step": handle.step,
                "outcome": "committed",
                "time": p.started_wall,
                "tier": self._tiers[0].name,
                **stats.to_json(),
            }
        )
        for tier in self._tiers:
            if tier.index > 0 and tier.due(now):
                self._send(tier, handle, now)
        handle._set_result(info)
        self._retain(self._tiers[0], self._tiers[0].policy)

    # -- drains to later tiers ---------------------------------------------------------------------

    def _send(self, tier: TierRuntime, handle: SaveHandle, now: float) -> None:
        """Queue the drain of ``handle``'s checkpoint to ``tier``; a tier still busy with an earlier one
        cannot keep up: this save is not sent to it and its cadence is widened (a warning says so)."""
        if tier.drainer is None:
            return
        if tier.busy is not None and not tier.busy.done():
            tier.skipped += 1
            running = now - (tier.last_sent_mono or now)
            tier.widened_every = max(tier.every + 1, self._needed_every(tier, max(tier.last_drain_s, running)))
            self._log_event(
                {
                    "step": handle.step,
                    "tier": tier.name,
                    "outcome": "drain_skipped",
                    "time": time.time(),
                    "reason": "previous drain still running",
                }
            )
            _background_warning(
                f"tier {tier.name} ({tier.storage.uri}) cannot keep up: it is still copying an earlier checkpoint "
                f"({running:.1f} s so far), so step {handle.step} is not sent to it; it now gets every "
                f"{tier.every}-th checkpoint (configured: every {tier.spec.every}; {tier.skipped} skipped so far)"
            )
            return
        future: Future[CheckpointInfo | None] = Future()
        handle.tiers[tier.name] = future
        tier.sent += 1
        tier.last_sent_mono = now
        self._protection.hold(0, handle.step)  # the source copy must outlive the drain
        tier.busy = tier.drainer.submit(self._drain, tier, handle.step, future)

    def _needed_every(self, tier: TierRuntime, drain_s: float) -> int:
        """How many saves apart a tier whose drain takes ``drain_s`` must receive them to keep up (the
        schedule's answer when it has one, else from the measured time between saves)."""
        tier_every = getattr(self._schedule, "tier_every", None)
        if callable(tier_every):
            return max(1, int(tier_every(drain_s)))
        period = self._save_period_s
        return max(1, math.ceil(drain_s / period)) if period and period > 0 else 1

    def _drain(self, tier: TierRuntime, step: int, future: Future[CheckpointInfo | None]) -> None:
        source = self._tiers[0]
        started, started_wall = time.perf_counter(), time.time()
        try:
            result = copy_checkpoint(source.storage, tier.storage, step, if_exists="skip", executor=tier.copier)
            info = tier.catalog.info(step)
        except BaseException as exc:
            self._protection.release(0, step)
            self._log_event(
                {"step": step, "tier": tier.name, "outcome": "drain_failed", "time": started_wall, "error": str(exc)}
            )
            _background_warning(
                f"copying step {step} to tier {tier.name} ({tier.storage.uri}) failed: {exc}; the checkpoint is "
                f"safe on {source.name}, and the next due save will be sent again"
            )
            future.set_exception(exc)  # after the warning: whoever waits on the future has seen both
            return
        self._protection.release(0, step)
        seconds = time.perf_counter() - started
        tier.last_drain_s = seconds
        self._log_event(
            {
                "step": step,
                "tier": tier.name,
                "outcome": "drained",
                "time": started_wall,
                "total_s": round(seconds, 6),
                "stored_bytes": result.stored_bytes,
                "write_gbps": round(result.stored_bytes / seconds / 1e9, 4) if seconds > 0 else 0.0,
            }
        )
        future.set_result(info)
        self._adjust_cadence(tier)
        self._retain(tier, tier.policy)

    def _adjust_cadence(self, tier: TierRuntime) -> None:
        """After a drain: a widened tier whose drains got faster returns toward its configured cadence."""
        if tier.widened_every > 1:
            tier.widened_every = min(tier.widened_every, self._needed_every(tier, tier.last_drain_s))

    def _log_event(self, record: dict[str, Any]) -> None:
        if self.events is not None:
            self.events.append(record)

    def _abort_prefix(self, prefix: str) -> None:
        try:
            self._commit.abort(prefix)
        except Exception:  # keep the original error; prune removes what is left
            log.warning("could not remove %s after a failed save", prefix, exc_info=True)

    def _retain(
        self, tier: TierRuntime, policy: RetentionPolicy | None, *, warn: bool = True, leftovers: bool = False
    ) -> builtins.list[int]:
        """Delete what ``policy`` does not keep on ``tier``: never a protected step (being drained from or
        read), never the tier's newest checkpoint. Returns the deleted steps."""
        if policy is None and not leftovers:
            return []
        try:
            result = tier.catalog.prune(
                policy=policy, protected=self._protection.steps(tier.index), leftovers=leftovers
            )
        except TiersaveError as exc:
            if not warn:
                raise
            _background_warning(f"retention on tier {tier.name} failed: {exc}")
            return []
        return result.deleted

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

        Tiers are tried fastest first: a copy that is missing or fails verification is reported
        (``TiersaveWarning``) and the same step is read from the next tier holding it; with ``step=None``,
        when no tier has a good copy of the newest step, the next older step is tried.

        Args:
            step: the step to restore; None means the newest.
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
        holders: dict[int, builtins.list[TierRuntime]] = {}
        missing: builtins.list[CheckpointNotFoundError] = []
        for tier in self._tiers:
            try:
                found = tier.catalog.find(step, tag)
            except CheckpointNotFoundError as exc:
                missing.append(exc)
                continue
            for s in found:
                holders.setdefault(s, []).append(tier)
        if not holders:
            if len(missing) == 1:
                raise missing[0]
            if missing:
                raise CheckpointNotFoundError("; ".join(str(e) for e in missing))
            where = ", ".join(t.storage.uri for t in self._tiers)
            raise CheckpointNotFoundError(f"no committed checkpoint in {where}")
        skipped: builtins.list[tuple[int, str]] = []
        last_error: TiersaveError | None = None
        for candidate in sorted(holders, reverse=True):
            for tier in holders[candidate]:
                try:
                    result, nbytes, in_place = self._restore_one(tier, candidate, into, strict)
                except (FormatError, CheckpointNotFoundError, StorageError) as exc:  # this copy is unusable
                    last_error = exc
                    skipped.append((candidate, f"on {tier.name}: {exc}"))
                    fallback = "another tier" if tier is not holders[candidate][-1] else "an older checkpoint"
                    if step is not None and tier is holders[candidate][-1]:
                        break
                    warnings.warn(
                        f"skipping the copy of step {candidate} on tier {tier.name} ({tier.storage.uri}): {exc}; "
                        f"trying {fallback}",
                        TiersaveWarning,
                        stacklevel=2,
                    )
                    continue
                self.last_restore = RestoreReport(
                    candidate,
                    tier.catalog.location(candidate),
                    nbytes,
                    time.perf_counter() - start,
                    in_place,
                    skipped,
                    tier.name,
                )
                return result
        if step is not None and last_error is not None and len(skipped) == 1:
            raise last_error
        raise CorruptCheckpointError(
            "no usable checkpoint: every candidate failed: " + "; ".join(f"step {s} {why}" for s, why in skipped)
        ) from last_error

    def _restore_one(self, tier: TierRuntime, step: int, into: Any, strict: bool) -> tuple[Any, int, int]:
        self._protection.hold(tier.index, step)  # retention must not delete what we are reading
        try:
            with tier.catalog.open(step) as ckpt:
                return Restore(ckpt, into, strict).run(self._pool)
        finally:
            self._protection.release(tier.index, step)


def _io_bytes(storage: Storage) -> dict[str, int] | None:
    """Bytes the storage moved per I/O path so far (storages with I/O statistics only)."""
    io_stats = getattr(storage, "io_stats", None)
    return io_stats.bytes_by_path() if io_stats is not None else None


def _background_warning(message: str) -> None:
    """Warn from a background thread: logged always, and a ``TiersaveWarning`` unless warnings are
    configured as errors (an exception here would kill the thread doing the work, not reach the user)."""
    log.warning("%s", message)
    try:
        warnings.warn(message, TiersaveWarning, stacklevel=2)
    except Warning:
        pass


def _event_log(tiers: Sequence[TierRuntime]) -> EventLog | None:
    """The event log goes in the first local tier that is durable, else the first local one."""
    local = [t for t in tiers if getattr(t.storage, "root", None) is not None]
    chosen = next((t for t in local if t.storage.capabilities.durable), local[0] if local else None)
    return EventLog(Path(chosen.storage.root) / EVENTS_NAME) if chosen is not None else None  # type: ignore[attr-defined]


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
