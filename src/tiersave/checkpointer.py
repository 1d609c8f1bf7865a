"""``Checkpointer``: save a training state as a checkpoint and restore it, atomically and verified.

Scope: the user-facing API, its validation and its lifecycle (close, context manager, interpreter exit and
SIGTERM); what a save does while another is in flight (``on_busy``); the schedule (``due``); the threads a save
crosses. It orchestrates, and holds no mechanism of its own: one save's stage/write/commit is
:class:`~tiersave.saving.Saver`; the tiers, drains, cadence, retention and listing are
:class:`~tiersave.tiers.TierChain`; choosing and reading a copy to restore is :func:`~tiersave.restore.restore_from`.
Anti-scope: byte layout (format/), storage details (storage/), moving bytes (engine/).

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
import os
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Literal

from . import _lifecycle, knobs
from .catalog import CheckpointInfo, VerifyReport
from .collective import join
from .engine.pool import DaemonThreadPool
from .errors import ClosedError, ConfigError, SaveError, TiersaveWarning
from .format.layout import MAX_CHUNK_BYTES
from .handle import SaveHandle
from .lazy import Guard
from .partial import Selection
from .planner.schedule import SaveCost, Schedule, parse_schedule
from .policy import RetentionPolicy
from .references import check_incremental
from .replication import attach
from .restore import RestoreReport, restore_from
from .saving import Saver, SaveRequest, complete_and_follow
from .storage.base import Storage
from .storage.lock import RootLocks
from .tags import MovableTag, tag_step
from .tiers import TierChain
from .tierspec import Tier, to_policy

__all__ = ["Checkpointer"]

OnBusy = Literal["wait", "skip", "raise"]


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
        process_group: with ``torch.distributed`` initialized, the Checkpointer is collective (every rank
            saves and restores its own state into one checkpoint per step; docs/distributed.md). Its
            coordination runs on a gloo group of its own, never the training's; pass a gloo group to use it.
        coordination_timeout_s: how long a collective save or restore waits for the other ranks before it
            fails with ``DistributedCheckpointError`` naming the ranks that did not answer.
        writer_lock: hold each tier's writer lock from the first save, ``prune`` or ``prepare`` until ``close()``
            (rank 0 only), so a second live writer of a root gets ``WriterLockedError`` naming this one; a
            restore never takes it. False (or ``TIERSAVE_WRITER_LOCK=0``): docs/guarantees.md.
        incremental, full_every: reference the first tier's shards equal to the newest checkpoint's instead of
            writing them; every ``full_every`` saves a full one (docs/format.md section 9; with many ranks, each
            rank references its own shards).
        guard: an optimizer or module, or a list of them, that lazy saves guard (:meth:`guard`).

    Thread safety: one thread calls save/restore at a time, listing from any. A context manager, or ``close()``.
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
        process_group: Any = None,
        coordination_timeout_s: float = 600.0,
        writer_lock: bool = True,
        incremental: bool = False,
        full_every: int | None = None,
        guard: Any = None,
    ) -> None:
        threads, chunk = _check_options(keep_last, io_threads, chunk_bytes, max_shard_bytes, on_busy, exit_timeout_s)
        self._collective = join(process_group, coordination_timeout_s)
        if self._collective is not None and on_busy != "wait":
            raise ConfigError(f"on_busy={on_busy!r} is not allowed in a collective Checkpointer: ranks must save alike")
        self._rank = self._collective.rank if self._collective is not None else 0
        self._schedule = parse_schedule(schedule)
        tier_every = getattr(self._schedule, "tier_every", None)
        self._chain = TierChain.of(
            root,
            tiers,
            default_keep=keep_last,
            io_threads=threads,
            tier_every=tier_every if callable(tier_every) else None,
            event_log=event_log and self._rank == 0,  # one log per job: rank 0's
        )
        first = self._chain.first
        attach(self._chain, self._collective)  # peer replicas of a memory tier; on failure, shuts the chain down
        self.storage: Storage = first.storage
        self.catalog = first.catalog
        self.events = self._chain.events
        self.keep_last = keep_last
        self.chunk_bytes = chunk
        self.max_shard_bytes = max_shard_bytes
        self.on_busy: OnBusy = on_busy
        self.exit_timeout_s = float(exit_timeout_s)
        self._pool = DaemonThreadPool(threads, "tiersave-io")
        self._committer = DaemonThreadPool(1, "tiersave-commit")
        self._saver = Saver(
            first,
            chunk_bytes=chunk,
            max_shard_bytes=max_shard_bytes,
            staging_bytes=staging_bytes,
            pool=self._pool,
            log_event=self._chain.log,
            group=self._collective.group if self._collective is not None else None,
            incremental=check_incremental(incremental, full_every),
        )
        self._saver.guard.add(guard if guard is not None else ())
        self._lock = threading.Lock()
        self._roots = RootLocks(lambda: (t.storage for t in self._chain.tiers), enabled=writer_lock and not self._rank)
        self._last: SaveHandle | None = None
        self._inflight: SaveHandle | None = None
        self._last_wait: _lifecycle.WaitOutcome | None = None  # what the last wait() found when it ended
        self._closed = False
        self.skipped_saves = 0
        self.last_restore: RestoreReport | None = None
        _lifecycle.register(self, handle_sigterm=handle_sigterm)

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> bool:
        """Wait for the in-flight save (up to ``timeout``, default ``exit_timeout_s``), then release the
        threads and the staging memory. Idempotent.

        Returns:
            True if nothing was left unfinished. A warning names what was: a save that had not committed
            (closing does not stop it: it becomes visible only if it commits; until then the previous
            checkpoint stays the newest), or a committed save's follow-up.

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
        self._chain.shutdown(wait=finished)
        self._saver.close(release_memory=finished)
        if finished:  # an unfinished save keeps the writer locks until the process ends
            self._roots.release()
        else:
            _warn_unfinished(self._last_wait, self.storage.uri)
        _raise_unobserved(self._last)  # a failed save is raised even while an earlier one's drain runs on
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
            raise ClosedError(f"this Checkpointer ({self.storage.uri}) is closed")

    def wait(self, timeout: float | None = None, *, raise_errors: bool = True) -> bool:
        """Wait until no save is in flight and its follow-up work (drains to later tiers, retention) is done.

        Returns:
            False if ``timeout`` seconds passed first.

        Raises:
            TiersaveError: the last save failed (when ``raise_errors``), as itself, even when an earlier save's
                follow-up is still running; the error counts as observed.
        """
        pending = self._inflight
        if pending is None:
            return True
        self._last_wait = _lifecycle.wait_for(pending, _follow_ups(self._committer, self._chain), timeout)
        if raise_errors and self._last_wait.error is not None:  # as itself, even if earlier drains are slow
            pending.exception()  # now observed: close() and the exit hook do not report it again
            raise self._last_wait.error
        return not self._last_wait.unfinished

    def _exit_state(self) -> _lifecycle.ExitState | None:
        """What the exit hook needs to finish or report the in-flight save; None once closed."""
        if self._closed:
            return None
        return _lifecycle.ExitState(self.storage.uri, self._saver.staging_step, self._inflight, self.exit_timeout_s)

    # -- listing ----------------------------------------------------------------------------------

    @property
    def tiers(self) -> builtins.list[str]:
        """Names of the tiers, fastest first."""
        return self._chain.names

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints with valid manifests, oldest first, each with the tiers holding it (described
        by the fastest copy) and its tags, the movable tags (:meth:`tag`) included."""
        return self._chain.list()

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint with a valid manifest in any tier, or None."""
        return self._chain.latest()

    def info(self, step: int, *, tier: str | None = None) -> CheckpointInfo:
        """The info of ``step`` on ``tier`` (default: the fastest tier holding it)."""
        return self._chain.info(step, tier=tier)

    def verify(self, step: int | None = None, *, tier: str | None = None) -> VerifyReport:
        """Check every byte of a checkpoint (default: the newest) on ``tier`` (default: the first) against checksums."""
        runtime = self._chain.get(tier)
        return runtime.catalog.verify(step if step is not None else runtime.newest(), executor=self._pool)

    def tag(self, step: int, name: str) -> MovableTag:
        """Point the movable tag ``name`` at committed ``step`` on the first tier, or move it (docs/quickstart.md)."""
        return tag_step(self.catalog, step, name)

    def untag(self, name: str) -> bool:
        """Remove the movable tag ``name`` from the first tier; returns whether it existed."""
        return self.catalog.tags.delete(name)

    def prune(
        self, keep_last: int | None = None, *, policy: RetentionPolicy | str | None = None, tier: str | None = None
    ) -> builtins.list[int]:
        """Apply retention now on ``tier`` (default: every tier): keep the ``keep_last`` newest or what ``policy``
        keeps, never a step being read or drained, a tier's newest or a movable tag's step; remove the leftovers
        of interrupted saves. Returns the deleted steps (of every tier pruned)."""
        chosen = _prune_policy(keep_last, policy)
        self._roots.hold()
        return self._chain.prune(chosen, tier=tier)

    def prepare(self, state: Any) -> None:
        """Do now, before training starts, the one-time work the first save would otherwise pay: allocate
        (and fault in) the staging memory for ``state``, and calibrate the I/O policy of local tiers.

        Optional: without it the first save is slower than the rest (about 1.5 s per GB of state here).
        """
        self._check_open()
        self._roots.hold()
        self._saver.prepare(state)
        self._chain.calibrate()

    def guard(self, *owners: Any, timeout_s: float | None = None) -> Guard:
        """Let ``save_async(..., lazy=True)`` return before its copy ends: each of these optimizers' ``step()`` and
        modules' ``forward()`` then waits (at most ``timeout_s``) until the tensors it changes are staged
        (docs/guarantees.md, "Lazy snapshot"). Returns the guard, whose ``waited_s`` is the stall that remains."""
        return self._saver.guard.add(*owners, timeout_s=timeout_s)

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
        replicated: Iterable[str] = (),
        lazy: bool = False,
    ) -> SaveHandle:
        """``save(..., blocking=False)``: return once the state is staged (with ``lazy``, once what no guard covers
        is); write in the background."""
        return self.save(
            step, state, metrics=metrics, tags=tags, metadata=metadata, replicated=replicated, blocking=False, lazy=lazy
        )

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: Mapping[str, float] | None = None,
        tags: Iterable[str] = (),
        metadata: Mapping[str, Any] | None = None,
        replicated: Iterable[str] = (),
        blocking: bool = True,
        lazy: bool = False,
    ) -> SaveHandle:
        """Save ``state`` as the checkpoint of ``step``.

        The call blocks while the state's bytes are copied into the staging arena (from the GPU with
        non-blocking copies on a side stream). With ``blocking=True`` it then waits until the checkpoint
        is committed and durable; with ``blocking=False`` it returns at once and the handle tells when
        the save is durable (``handle.result()``), re-raising any background error. Once this returns,
        changes to the state's tensors never leak into the checkpoint (with ``lazy``: see :meth:`guard`).

        Args:
            step: a non-negative integer; a step that is already committed is never overwritten.
            state: the state tree (see :mod:`tiersave.state` for what it may hold).
            metrics: finite numbers recorded in the manifest (used by keep-best retention).
            tags: names such as ``"best"`` or ``"milestone"`` to find the checkpoint by later.
            metadata: free JSON-serializable data recorded in the manifest.
            replicated: top-level keys of ``state`` identical on every rank (DDP weights and optimizer state):
                written once in total, split across ranks, checked at the first save (docs/distributed.md).
            blocking: wait until the checkpoint is durable (default) or only until it is staged.
            lazy: (``blocking=False``) return before the guarded tensors are staged; the guard's hooks wait.

        Returns:
            A :class:`SaveHandle`; one skipped by ``on_busy="skip"`` has ``skipped=True``, ``result()`` None.

        Raises:
            ConfigError: a bad step, metric, tag or metadata value.
            UnsupportedStateError: the state holds an object that cannot be saved.
            AlreadyExistsError: ``step`` is already committed.
            StorageError: the write failed (out of space, permission...); nothing became visible.
            SaveError: an earlier save failed and its error was never observed, or ``on_busy="raise"``
                and a save is in flight.
        """
        self._check_open()
        _raise_unobserved(self._last)
        request = SaveRequest.validate(step, metrics, tags, metadata, replicated)
        started, started_wall, started_mono = time.perf_counter(), time.time(), time.monotonic()
        previous = self._inflight
        if previous is not None and not previous.done():
            if self.on_busy == "skip":
                self.skipped_saves += 1
                return _skip(self._chain, request.step, previous.step, self.skipped_saves, started_wall)
            if self.on_busy == "raise":
                raise SaveError(f"the save of step {previous.step} is still being written (on_busy='raise')")
            previous.wait()
            _raise_unobserved(self._last)
        self._saver.check_replicated(request, state, self._committer, blocking)  # before anything is staged
        handle = SaveHandle(request.step)
        with self._lock:
            self._last = handle
            self._inflight = handle
        token = self._collective.next_token() if self._collective is not None else None
        try:
            self._roots.hold()  # refused: this save fails here (the collective's other ranks by the vote below)
            pending = self._saver.stage(handle, request, state, started, started_wall, blocking, token, lazy)
        except BaseException as exc:
            _staging_failed(handle, exc, self._saver, self._committer if self._collective is not None else None)
            raise
        self._committer.submit(complete_and_follow, self._saver, self._chain, pending)
        if self._schedule is not None:
            _record_cost(self._schedule, handle, self._saver.last_total_s, started_mono)
        if blocking:
            handle.result()
            self._committer.submit(lambda: None).result()  # and the first tier's retention after it
        return handle

    # -- restore ----------------------------------------------------------------------------------

    def restore(
        self,
        step: int | None = None,
        *,
        tag: str | None = None,
        into: Any = None,
        strict: bool = True,
        rank: int | None = None,
        keys: str | Sequence[str] | None = None,
        cast: bool = False,
        dtype: Any = None,
    ) -> Any:
        """Restore a checkpoint and return the state.

        With ``into``, tensors are read straight into the live tensors' memory where dtype, shape and
        device allow (no extra full copy), stateful objects get ``load_state_dict``, and dicts/lists are
        updated in place; ``into`` itself is returned. Without it, a new tree of CPU tensors is returned.

        Tiers are tried fastest first: a missing or damaged copy is reported (``TiersaveWarning``) and the next tier
        holding the step is read; with ``step=None``, when no tier has a good copy, the next older step is tried.

        Args:
            step: the step to restore; None means the newest.
            tag: restore the newest checkpoint carrying this tag.
            into: the live state to load into: all of the saved structure or a part (only that part is read).
            strict: with ``into``, fail when ``into`` has keys the checkpoint lacks. False: leave out what ``into``
                cannot take (a new head) and report it in ``last_restore`` and a log line (docs/quickstart.md).
            keys: read only these paths of the saved tree (``"model"``, ``"model.encoder"``).
            cast: convert floating-point tensors to the live dtype (else a dtype mismatch is an error).
            dtype: return floating-point tensors as this ``torch.dtype`` (implies ``cast``).
            rank: in a single process, read rank ``rank``'s state of a checkpoint saved by several ranks (in a
                collective Checkpointer each rank restores its own; the number of ranks must match).

        Raises:
            CheckpointNotFoundError: no committed checkpoint matches.
            CorruptCheckpointError / FormatError: the requested (or every) checkpoint failed to verify.
            StateMismatchError: the live state cannot hold the checkpoint, a path of ``keys`` names nothing in
                it, or it was saved by another number of ranks (reshard through ``tiersave.dcp``).
            DistributedCheckpointError: (collective) another rank failed or did not answer in time.

        Collective: every rank tries rank 0's list of copies in order, moving on only together (the same step on all).

        If reading fails midway, ``into``'s tensors may hold partial data; nothing is loaded unless all verified.
        """
        self._check_open()
        self._saver.guard.settle()  # a lazy save still staging must not see the restored values
        sel = Selection.of(keys, cast, dtype)
        result, self.last_restore = restore_from(
            self._chain, step, tag, into, strict, self._pool, collective=self._collective, rank=rank, selection=sel
        )
        return result


def _check_options(
    keep_last: int | None,
    io_threads: int | None,
    chunk_bytes: int | None,
    max_shard_bytes: int | None,
    on_busy: str,
    exit_timeout_s: float,
) -> tuple[int, int]:
    """Validate the Checkpointer's numeric options; returns the I/O threads and the chunk size in use."""
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
    return threads, chunk


def _raise_unobserved(last: SaveHandle | None) -> None:
    """Raise the error of the last save if it failed in the background and nobody observed it."""
    if last is None:
        return
    err = last._unobserved_error()
    if err is not None:
        last._observed = True
        raise SaveError(f"the save of step {last.step} failed and nobody observed it: {err}") from err


def _warn_unfinished(outcome: _lifecycle.WaitOutcome | None, uri: str) -> None:
    message = _lifecycle.unfinished_message(outcome, uri, "before close")
    warnings.warn(f"tiersave: {message}", TiersaveWarning, stacklevel=3)


def _follow_ups(committer: DaemonThreadPool, chain: TierChain) -> builtins.list[tuple[str, Executor]]:
    """The single-threaded queues that a committed save's follow-up runs on, in the order they hand work on (the
    commit thread queues the drains and the removals), each named for a message saying it did not finish."""
    retention = f"the retention of tier {chain.first.name} (what it would delete stays until a later retention)"
    return [(retention, committer), *chain.follow_ups()]


def _prune_policy(keep_last: int | None, policy: RetentionPolicy | str | None) -> RetentionPolicy | None:
    """``prune()``'s arguments as one policy: exactly one of ``keep_last`` and ``policy``."""
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"keep_last must be a positive integer, got {keep_last!r}")
    if (keep_last is None) == (policy is None):
        raise ConfigError("give prune() either keep_last or policy")
    return to_policy(keep_last if policy is None else policy)


def _staging_failed(handle: SaveHandle, exc: BaseException, saver: Saver, committer: DaemonThreadPool | None) -> None:
    """A save failed before it was handed to the commit thread: its handle holds the (raised, so observed)
    error, and in a collective Checkpointer (``committer`` given) the other ranks learn of it by a "no" vote
    at once, not at their timeout."""
    if not handle.done():
        handle._set_error(exc)
        handle._observed = True
    if committer is not None:
        committer.submit(saver.vote_no, handle.step, exc, saver.abandoned_prefix)


def _record_cost(schedule: Schedule, handle: SaveHandle, drain_s: float, started_mono: float) -> None:
    """Tell an adaptive schedule what this save cost the loop (blocked) and the background (drain)."""
    schedule.record(
        SaveCost(step=handle.step, blocked_s=handle.stats.blocked_s, drain_s=drain_s, wall_time=started_mono)
    )


def _skip(chain: TierChain, step: int, busy_step: int, skipped: int, started_wall: float) -> SaveHandle:
    """``on_busy="skip"``: warn, record it in the event log, return the skipped save's handle."""
    warnings.warn(
        f"skipping the save of step {step}: the save of step {busy_step} is still being written "
        f"({skipped} skipped so far)",
        TiersaveWarning,
        stacklevel=3,
    )
    chain.log(
        {"step": step, "outcome": "skipped", "time": started_wall, "reason": f"save of step {busy_step} in flight"}
    )
    return SaveHandle.skipped_save(step)
