"""Tiers: where checkpoints go, how often, how many are kept, and how they drain down the chain.

A ``Checkpointer`` owns an ordered chain of tiers, fastest first, e.g.::

    Checkpointer(tiers=[
        Tier("mem://run1", keep=2),                       # every save, in RAM; survives a process crash
        Tier("/local/ckpt", every=5, keep="last=3"),      # every 5th save, on the node's disk
        Tier("s3://bucket/run1?endpoint=...", every=20, keep="last=5,every=10000,best=2:loss:min"),
    ])

The first tier receives every save (it is where staging writes). Every later tier receives the saves its
cadence selects (``every`` N-th save, or at most one per ``every_s`` seconds), copied in the background
from the first tier by that tier's own drain thread, verified chunk by chunk and committed with the
tier's own commit protocol; each tier acknowledges a checkpoint only once it is durable there. A save due
while the tier is still busy is deferred and copied as soon as the tier is idle (the newest deferred one:
never an ever-growing queue), so the newest checkpoint always reaches every tier it is due on. A tier found
busy twice in a row gets every N-th checkpoint instead (a warning says so). Retention runs per tier after
each commit there and never deletes a checkpoint that a drain or a restore is reading, nor the newest
checkpoint durable on that tier.

Scope: each tier's runtime state (:class:`TierRuntime`) and the chain at run time (:class:`TierChain`): which
tiers hold which step, what happens after the first tier commits (cadence, drains to later tiers, widening a
tier that cannot keep up), retention per tier, and the protection of steps being read. Anti-scope: a tier's
configuration (tierspec.py), moving bytes (drain.py copies one checkpoint), what to keep (policy.py), staging
and committing a save (saving.py), the user-facing API (checkpointer.py).

Thread safety: the commit thread calls :meth:`TierChain.after_commit`; each later tier's drain runs on that
tier's own drain thread; listing may run on any thread.
"""

from __future__ import annotations

import builtins
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ._futures import running_future
from .autocompress import AutoCompress
from .catalog import Catalog, CheckpointInfo
from .commit import CommitStrategy, commit_for
from .drain_refs import drain_to
from .engine.pool import DaemonThreadPool
from .errors import CheckpointNotFoundError, ConfigError, DrainSupersededError, FormatError, TiersaveError
from .events import EVENTS_NAME, EventLog, background_warning
from .format.manifest import Manifest
from .leases import Reclaim
from .policy import KeepLast, RetentionPolicy
from .reclaim import Reclaimer
from .references import Protection
from .storage import open_storage
from .storage.base import Storage
from .tierspec import Tier, default_name, to_policy
from .units import ordinal

if TYPE_CHECKING:  # pragma: no cover
    from .handle import SaveHandle

__all__ = ["Tier", "TierChain"]

DEFAULT_VOLATILE_KEEP = 2
"""Checkpoints a non-durable tier (RAM) keeps when its ``keep`` is not given: bounded memory by default."""


class TierRuntime:
    """A tier in use: its storage, catalog, commit protocol, policy and drain state."""

    def __init__(self, spec: Tier, index: int, *, default_keep: int | None, io_threads: int) -> None:
        self.spec = spec
        self.index = index
        self.storage: Storage = open_storage(spec.uri, io=spec.io)
        self.name = spec.name or default_name(spec.uri, self.storage)
        self.catalog = Catalog(self.storage)
        self.commit: CommitStrategy = commit_for(self.storage)
        policy = to_policy(spec.keep)
        if policy is None and default_keep is not None:
            policy = KeepLast(default_keep)
        if policy is None and not self.storage.capabilities.durable:
            policy = KeepLast(DEFAULT_VOLATILE_KEEP)
        self.policy = policy
        self.io_threads = io_threads
        self.sent = 0
        self.considered = 0
        self.last_sent_mono: float | None = None
        self.widened_every = 1
        self.last_drain_s = 0.0
        self.skipped = 0
        self.warned_unhashed = False  # drain_refs.py: said once that the source has no content hashes
        self.busy_streak = 0  # consecutive due saves that found the drain busy
        self.behind: int | None = None  # newest due save skipped while busy: drained as soon as the tier is idle
        self.behind_future: Future[CheckpointInfo | None] | None = None  # its handle's tier_result
        self.draining = False  # a drain task is queued or running (TierChain._lock): due saves wait behind it
        self.drainer: DaemonThreadPool | None = None
        self.copier: DaemonThreadPool | None = None
        self.auto = AutoCompress(self.name, io_threads) if spec.compress == "auto" and index else None
        if index > 0:
            self.drainer = DaemonThreadPool(1, f"tiersave-drain-{self.name}")
            self.copier = DaemonThreadPool(io_threads, f"tiersave-copy-{self.name}")

    @property
    def every(self) -> int:
        """The cadence in use: the configured one, widened when the drain cannot keep up."""
        return max(self.spec.every, self.widened_every)

    def due(self, now_mono: float) -> bool:
        """Whether the save being committed now goes to this tier (advances the save counter)."""
        self.considered += 1
        return self.index == 0 or self._selects(now_mono, self.widened_every)

    def configured_due(self, now_mono: float) -> bool:
        """After :meth:`due`: whether the configured cadence, widened or not, selects that save."""
        return self.index == 0 or self._selects(now_mono, 1)

    def _selects(self, now_mono: float, widened: int) -> bool:
        if self.spec.every_s is not None:
            since = math.inf if self.last_sent_mono is None else now_mono - self.last_sent_mono
            return since >= self.spec.every_s * widened
        return self.considered % max(self.spec.every, widened) == 0

    def newest(self) -> int:
        """The newest committed step on this tier.

        Raises:
            CheckpointNotFoundError: nothing is committed here.
        """
        steps = self.catalog.steps()
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.storage.uri}")
        return steps[-1]

    def drained_elsewhere(self, *, copies: bool) -> None:
        """Another owner (partdrain.py) runs this tier's drains: stop its drain thread, and its copy pool too
        when this process copies nothing (``copies`` False)."""
        stopped = (self.drainer, None if copies else self.copier)
        self.drainer = None
        self.copier = self.copier if copies else None
        for pool in stopped:
            if pool is not None:
                pool.shutdown(wait=False)

    def shutdown(self, wait: bool) -> None:
        for pool in (self.drainer, self.copier):
            if pool is not None:
                pool.shutdown(wait=wait)


class Companion(Protocol):
    """Background work that lives beside a chain's drains (the peer replicas of its memory tier): the
    Checkpointer waits for its pools like for the drains, and closes it with the chain."""

    def after_commit(self, handle: SaveHandle, chain: TierChain) -> None: ...

    def pools(self) -> builtins.list[DaemonThreadPool]: ...

    def follow_up(self, first: TierRuntime) -> str: ...  # what its pools do, for "it did not finish" words

    def close(self, wait: bool = True) -> None: ...


def check_chain(tiers: list[TierRuntime]) -> None:
    """Validate a chain: a first tier that takes every save, distinct names and locations."""
    if not tiers:
        raise ConfigError("a Checkpointer needs at least one tier (a root path or tiers=[...])")
    first = tiers[0].spec
    if first.every != 1 or first.every_s is not None:
        raise ConfigError(f"the first tier ({tiers[0].name}) receives every save; give cadences to later tiers")
    for later in tiers[1:]:
        if later.spec.replicas:
            raise ConfigError(f"replicas= applies to the first tier (a memory tier), not to {later.name}")
    if first.compress is not None or first.incremental:  # the first tier's saves: Checkpointer(incremental=True)
        raise ConfigError(f"compress= or incremental= applies to later tiers (drained), not to {tiers[0].name}")
    names = [t.name for t in tiers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"tier names must differ; name them with Tier(..., name=...): {', '.join(duplicates)}")
    uris = [t.storage.uri for t in tiers]
    if len(set(uris)) != len(uris):
        raise ConfigError("two tiers point at the same place; each tier needs its own location")


class TierChain:
    """The tiers of one Checkpointer at run time, fastest first.

    Args:
        specs: the tiers, fastest first; the first receives every save.
        default_keep: retention of tiers whose ``keep`` is not given.
        io_threads: copy threads per later tier.
        tier_every: the schedule's answer to "how many saves apart must a tier whose drain takes this many
            seconds receive them" (``AutoSchedule.tier_every``), or None to use the measured save period.
        event_log: append each save's and drain's record to ``ROOT/tiersave-events.jsonl`` of the first local
            (preferably durable) tier.
    """

    def __init__(
        self,
        specs: Sequence[Tier],
        *,
        default_keep: int | None,
        io_threads: int,
        tier_every: Callable[[float], int] | None = None,
        event_log: bool = True,
    ) -> None:
        self.tiers: list[TierRuntime] = []
        try:
            for index, spec in enumerate(specs):
                self.tiers.append(TierRuntime(spec, index, default_keep=default_keep, io_threads=io_threads))
            check_chain(self.tiers)
        except BaseException:
            self.shutdown(wait=False)
            raise
        self.first = self.tiers[0]
        self.protection = Protection()
        self.events = _event_log(self.tiers) if event_log else None
        self._tier_every = tier_every
        self._lock = threading.Lock()  # a tier's busy/behind state: the commit thread and its drain thread
        self._last_commit_mono: float | None = None
        self._save_period_s: float | None = None
        self.reclaimer = Reclaimer()  # the first tier's deleted checkpoints' files, removed off the commit thread
        self.companions: builtins.list[Companion] = [self.reclaimer]  # background work beside the drains

    @classmethod
    def of(
        cls,
        root: str | os.PathLike[str] | Storage | None,
        tiers: Sequence[Tier | str | os.PathLike[str] | Storage] | None,
        **options: Any,
    ) -> TierChain:
        """The chain of a Checkpointer given either one ``root`` or ``tiers`` (paths, URIs, storages or
        :class:`Tier` objects); ``options`` as for the constructor."""
        if (root is None) == (tiers is None):
            raise ConfigError("give either a root (one tier) or tiers=[...], not both and not neither")
        chain: Sequence[Tier | str | os.PathLike[str] | Storage] = [root] if root is not None else (tiers or [])
        return cls([t if isinstance(t, Tier) else Tier(t) for t in chain], **options)

    @property
    def names(self) -> builtins.list[str]:
        return [t.name for t in self.tiers]

    def get(self, name: str | None) -> TierRuntime:
        """The tier called ``name``; the first tier for None."""
        if name is None:
            return self.first
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise ConfigError(f"no tier named {name!r}; tiers: {', '.join(self.names)}")

    def where(self) -> str:
        return ", ".join(t.storage.uri for t in self.tiers)

    def log(self, record: dict[str, Any]) -> None:
        if self.events is not None:
            self.events.append(record)

    def shutdown(self, wait: bool) -> None:
        for tier in self.tiers:
            tier.shutdown(wait=wait)
        for companion in getattr(self, "companions", ()):  # absent when a tier failed to open
            companion.close(wait=wait)

    def calibrate(self) -> None:
        """Calibrate now the I/O policy of every tier that has one (local file systems), not at a first save."""
        for tier in self.tiers:
            policy = getattr(tier.storage, "io_policy", None)
            if policy is not None:
                policy.ensure_calibrated()

    def follow_ups(self) -> builtins.list[tuple[str, DaemonThreadPool]]:
        """The drain and companion threads, whose queues ``Checkpointer.wait`` waits out, in the order they hand
        work on, each named for a message saying it did not finish."""
        out = [
            (f"the drain to tier {t.name} ({t.storage.uri}), which lacks the step it copies", t.drainer)
            for t in self.tiers
            if t.drainer is not None
        ]
        return out + [(c.follow_up(self.first), pool) for c in self.companions for pool in c.pools()]

    # -- listing ----------------------------------------------------------------------------------

    def holdings(self) -> dict[int, builtins.list[TierRuntime]]:
        """Committed step -> the tiers holding it, fastest first."""
        out: dict[int, builtins.list[TierRuntime]] = {}
        for tier in self.tiers:
            for step in tier.catalog.steps():
                out.setdefault(step, []).append(tier)
        return out

    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints with valid manifests, oldest first; each info describes the copy in the
        fastest tier holding the step and names every tier holding it."""
        out = []
        movable = {t.index: t.catalog.tags.by_step() for t in self.tiers}  # read once, not once per step
        for step, holders in sorted(self.holdings().items()):
            info = _first_valid(step, holders, movable)
            if info is not None:
                out.append(info)
        return out

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint with a valid manifest in any tier, or None."""
        for step, holders in sorted(self.holdings().items(), reverse=True):
            info = _first_valid(step, holders)
            if info is not None:
                return info
        return None

    def info(self, step: int, *, tier: str | None = None) -> CheckpointInfo:
        """The info of ``step`` on ``tier`` (default: the fastest tier holding it)."""
        holdings = self.holdings()
        holders = holdings.get(step, [])
        if tier is not None:
            holders = [t for t in holders if t.name == self.get(tier).name]
        if not holders:
            where = f"tier {tier!r}" if tier is not None else self.where()
            raise CheckpointNotFoundError(f"no checkpoint of step {step} in {where}")
        return replace(holders[0].catalog.info(step), tiers=tuple(t.name for t in holdings[step]))

    # -- after a commit on the first tier ---------------------------------------------------------

    def after_commit(self, handle: SaveHandle, manifest: Manifest, started_wall: float) -> None:
        """Commit thread, once the first tier committed ``manifest``: record it, send it to the later tiers
        its cadence selects, resolve ``handle``, then apply the first tier's retention."""
        now = time.monotonic()
        if self._last_commit_mono is not None:
            gap = now - self._last_commit_mono
            self._save_period_s = gap if self._save_period_s is None else 0.7 * self._save_period_s + 0.3 * gap
        self._last_commit_mono = now
        for companion in self.companions:  # before the handle resolves: they add their futures to it
            companion.after_commit(handle, self)
        info = self.first.catalog.remember(manifest)
        self.log(
            {
                "step": handle.step,
                "outcome": "committed",
                "time": started_wall,
                "tier": self.first.name,
                **handle.stats.to_json(),
            }
        )
        superseded: builtins.list[_Superseded] = []  # resolved after the handle: a callback may wait on it
        for tier in self.tiers[1:]:
            if tier.drainer is None:  # drained elsewhere: the owner counts the saves
                continue
            if tier.due(now):
                superseded.append(self._send(tier, handle, now))
            elif tier.configured_due(now):
                superseded.append(self._supersede(tier, handle))
        handle._set_result(info)
        for older in superseded:
            _supersede_future(*older)
        # retention, and the leftovers of dead writers of this host (a killed save's temporary files)
        self.retain(self.first, self.first.policy, leftovers=True, reclaim=self.reclaimer.later)

    def after_node_commit(self, handle: SaveHandle, manifest: Manifest) -> None:
        """Commit thread of another node's leader, once it committed ``manifest`` in its node-local first tier
        (rank 0 runs :meth:`after_commit`): record it, start the companions' work (replicas) and apply the
        tier's retention on this node."""
        for companion in self.companions:
            companion.after_commit(handle, self)
        self.first.catalog.remember(manifest)
        self.retain(self.first, self.first.policy, leftovers=True, reclaim=self.reclaimer.later)

    def _send(self, tier: TierRuntime, handle: SaveHandle, now: float) -> _Superseded:
        """Queue the drain of ``handle``'s checkpoint to ``tier``. A tier still busy with an earlier drain
        does not queue it: it remembers it as the save to catch up on (drained as soon as the tier is idle,
        so the newest checkpoint reaches every tier), and a tier found busy twice in a row cannot keep up:
        its cadence is widened (a warning says so)."""
        if tier.drainer is None:
            return None, None, handle.step, tier.name
        widen = False
        future: Future[CheckpointInfo | None] = running_future()
        handle.tiers[tier.name] = future  # sent now, or deferred: resolved by its drain, or when superseded
        with self._lock:
            deferred = tier.draining
            if deferred:
                tier.skipped += 1
                tier.busy_streak += 1
                superseded = self._wait_behind(tier, handle.step, future)
                running = now - (tier.last_sent_mono or now)
                widen = tier.busy_streak >= 2
                if widen:
                    tier.widened_every = max(tier.every + 1, self._needed_every(max(tier.last_drain_s, running)))
            else:
                tier.busy_streak, tier.draining = 0, True
                superseded = tier.behind, tier.behind_future  # this newer save supersedes the one waiting to catch up
                if tier.behind is not None:
                    self.protection.release(0, tier.behind)
                tier.behind = tier.behind_future = None
        if deferred:
            self._log_deferred(
                tier, handle.step, "previous drain still running; sent when it ends unless a newer save is"
            )
            if widen:
                background_warning(
                    f"tier {tier.name} ({tier.storage.uri}) cannot keep up: it is still copying an earlier "
                    f"checkpoint ({running:.1f} s so far) for the second save in a row; it now gets every "
                    f"{ordinal(tier.every)} checkpoint (configured: every {ordinal(tier.spec.every)}; the newest "
                    f"of those is sent as soon as it is idle; {tier.skipped} deferred so far)"
                )
            return (*superseded, handle.step, tier.name)
        tier.sent += 1
        tier.last_sent_mono = now
        self.protection.hold(0, handle.step)  # the source copy must outlive the drain
        try:
            tier.drainer.submit(self._drain, tier, handle.step, future)
        except BaseException as exc:  # closed (close() timed out while this commit ran): no drain will run
            with self._lock:
                tier.draining = False
            self.protection.release(0, handle.step)
            future.set_exception(exc)
        return (*superseded, handle.step, tier.name)

    def _supersede(self, tier: TierRuntime, handle: SaveHandle) -> _Superseded:
        """A save that the tier's configured cadence selects but its widened one leaves out replaces the save
        waiting to catch up there: still one catch-up, of a newer checkpoint, so a tier that cannot keep up ends a
        burst with the newest save it would have been sent. To an idle tier it is not sent (that is the widening)."""
        future: Future[CheckpointInfo | None] = running_future()
        with self._lock:
            older = tier.behind
            if not tier.draining or older is None:
                return None, None, handle.step, tier.name
            superseded = self._wait_behind(tier, handle.step, future)
        handle.tiers[tier.name] = future
        self._log_deferred(tier, handle.step, f"replaces step {older}, waiting to catch up (the cadence is widened)")
        return (*superseded, handle.step, tier.name)

    def _wait_behind(
        self, tier: TierRuntime, step: int, future: Future[CheckpointInfo | None]
    ) -> tuple[int | None, Future[CheckpointInfo | None] | None]:
        """Under ``self._lock``: ``step`` (its handle's ``future``) becomes the save to catch up on, superseding
        any other; returns the superseded one's step and future (resolved by the caller, outside the lock)."""
        older, older_future = tier.behind, tier.behind_future
        tier.behind, tier.behind_future = step, future
        self.protection.hold(0, step)  # the catch-up's source must outlive it: held before the older one is let go
        if older is not None:
            self.protection.release(0, older)
        return older, older_future

    def _log_deferred(self, tier: TierRuntime, step: int, reason: str) -> None:
        self.log({"step": step, "tier": tier.name, "outcome": "drain_deferred", "time": time.time(), "reason": reason})

    def _needed_every(self, drain_s: float) -> int:
        """How many saves apart a tier whose drain takes ``drain_s`` must receive them to keep up (the
        schedule's answer when it has one, else from the measured time between saves)."""
        if self._tier_every is not None:
            return max(1, int(self._tier_every(drain_s)))
        period = self._save_period_s
        return max(1, math.ceil(drain_s / period)) if period and period > 0 else 1

    def _drain(self, tier: TierRuntime, step: int, future: Future[CheckpointInfo | None]) -> None:
        """Drain thread: copy ``step`` to ``tier``; then, while a newer save waits to catch up, copy it too
        (in this task, so whoever waits for the drain queue waits for the catch-up too), also after a failed
        copy. Whether one waits and the end of ``tier.draining`` are decided under one lock (else a save
        deferred just after that look would have no drain left to send it), and each save's future is
        resolved after that: a save made once ``tier_result`` returned is sent, not deferred."""
        try:
            while True:
                outcome = self._drain_one(tier, step)
                with self._lock:
                    behind, behind_future = tier.behind, tier.behind_future
                    tier.behind = tier.behind_future = None
                    tier.draining = behind is not None and behind > step
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)  # after the warning: whoever waits on it has seen both
                else:
                    future.set_result(outcome)
                if behind is None or behind <= step:
                    if behind is not None:
                        self.protection.release(0, behind)
                        _supersede_future(behind, behind_future, step, tier.name)
                    return
                # its hold, taken when it was deferred, passes to this drain; its future is its handle's
                step, future = behind, behind_future if behind_future is not None else running_future()
                tier.sent += 1
                tier.last_sent_mono = time.monotonic()
                self.log({"step": step, "tier": tier.name, "outcome": "catch_up", "time": time.time()})
        except BaseException as exc:
            with self._lock:
                tier.draining = False
                behind, behind_future = tier.behind, tier.behind_future  # no drain is left to send it
                tier.behind = tier.behind_future = None
            if behind is not None:
                self.protection.release(0, behind)
            for pending in (future, behind_future):
                if pending is not None and not pending.done():
                    pending.set_exception(exc)
            raise

    def _drain_one(self, tier: TierRuntime, step: int) -> CheckpointInfo | BaseException | None:
        """Copy one checkpoint to ``tier``, release its source, apply the tier's retention. Returns its info
        there, or the copy's error (logged and warned about here)."""
        source = self.first
        started, started_wall = time.perf_counter(), time.time()
        try:
            result = drain_to(tier, source.catalog, step)
            info = tier.catalog.info(step)
        except BaseException as exc:
            self.protection.release(0, step)
            event = {"step": step, "tier": tier.name, "outcome": "drain_failed", "time": started_wall}
            self.log({**event, "error": str(exc)})
            background_warning(
                f"copying step {step} to tier {tier.name} ({tier.storage.uri}) failed: {exc}; the checkpoint is "
                f"safe on {source.name}; a save waiting behind it, or else the next due save, is sent"
            )
            return exc
        self.protection.release(0, step)
        seconds = time.perf_counter() - started
        tier.last_drain_s = seconds
        event = {"step": step, "tier": tier.name, "outcome": "drained", "time": started_wall}
        self.log({**event, **result.drained_event(seconds)})
        if tier.widened_every > 1:  # a widened tier whose drains got faster returns toward its cadence
            tier.widened_every = min(tier.widened_every, self._needed_every(tier.last_drain_s))
        self.retain(tier, tier.policy, leftovers=True)
        return info

    # -- retention --------------------------------------------------------------------------------

    def retain(
        self,
        tier: TierRuntime,
        policy: RetentionPolicy | None,
        *,
        warn: bool = True,
        leftovers: bool = False,
        reclaim: Reclaim | None = None,
    ) -> builtins.list[int]:
        """Delete what ``policy`` does not keep on ``tier``: never a protected step (being drained from or
        read), never the tier's newest checkpoint (``reclaim``: remove the files later). Returns the deleted
        steps."""
        if policy is None and not leftovers:
            return []
        try:
            protected = self.protection.steps(tier.index)
            result = tier.catalog.prune(policy=policy, protected=protected, leftovers=leftovers, reclaim=reclaim)
        except TiersaveError as exc:
            if not warn:
                raise
            background_warning(f"retention on tier {tier.name} failed: {exc}")
            return []
        return result.deleted

    def prune(self, policy: RetentionPolicy | None, *, tier: str | None = None) -> builtins.list[int]:
        """Apply ``policy`` now on ``tier`` (default: every tier) and remove leftovers of interrupted saves;
        errors are raised. Returns the deleted steps."""
        deleted: builtins.list[int] = []
        for runtime in [self.get(tier)] if tier is not None else self.tiers:
            deleted.extend(self.retain(runtime, policy, warn=False))
            if runtime.storage.capabilities.atomic_rename:
                runtime.catalog.clean_leftovers()
        return sorted(set(deleted))


def _first_valid(
    step: int, holders: Sequence[TierRuntime], movable: dict[int, dict[int, tuple[str, ...]]] | None = None
) -> CheckpointInfo | None:
    """The info of ``step`` from the fastest holder whose manifest is valid, naming every holder (``movable``:
    each tier's movable tags by step, when the caller read them once for many steps)."""
    for tier in holders:
        try:
            info = tier.catalog.info(step, movable[tier.index] if movable is not None else None)
            return replace(info, tiers=tuple(t.name for t in holders))
        except (FormatError, CheckpointNotFoundError):
            continue
    return None


def _event_log(tiers: Sequence[TierRuntime]) -> EventLog | None:
    """The event log goes in the first local tier that is durable, else the first local one."""
    local = [t for t in tiers if getattr(t.storage, "root", None) is not None]
    chosen = next((t for t in local if t.storage.capabilities.durable), local[0] if local else None)
    return EventLog(Path(chosen.storage.root) / EVENTS_NAME) if chosen is not None else None  # type: ignore[attr-defined]


_Superseded = tuple[int | None, "Future[CheckpointInfo | None] | None", int, str]
"""``(step, its tier future, the save that replaced it, tier name)``: a deferred save to tell it was superseded."""


def _supersede_future(step: int | None, future: Future[CheckpointInfo | None] | None, by: int, tier: str) -> None:
    """The tier result of the deferred save ``step``, replaced by save ``by`` before it was copied to ``tier``."""
    if step is not None and future is not None and not future.done():
        instead = f"step {by}, a newer save, took its place" if by > step else f"step {by} was copied there instead"
        future.set_exception(
            DrainSupersededError(
                f"step {step} was not copied to tier {tier}: it waited for the tier to be idle, and {instead} (a "
                "busy tier catches up on the newest due save only)"
            )
        )
