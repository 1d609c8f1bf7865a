"""One save into the first tier: validate, flatten, lay out and stage it, then write, build its manifest and commit.

A save crosses two threads. :meth:`Saver.stage` runs on the caller's thread: it flattens the state, lays the
tensors out, opens the attempt's prefix with the tier's commit protocol and copies every byte into the staging
arena (the only part that blocks training). :meth:`Saver.complete` runs on the commit thread: it waits for the
writes, makes the shards durable, builds the manifest from what was written and commits it. Either way, a
failure leaves nothing visible: the attempt's prefix is removed and the error is stored on the save's handle.

Scope: the life of one save on the first tier, and the validation of what a caller passes to ``save``.
Anti-scope: when to save and what a save does while another is in flight (checkpointer.py); later tiers,
drains and retention (tiers.py); moving the bytes (engine/); the manifest's encoding (format/).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import partdrain
from .catalog import CheckpointInfo
from .collective import global_manifest, rank_part
from .commit import CommitStrategy, check_shards_visible
from .engine.increment import Increment
from .engine.pipeline import GROUP_BYTES, StagedWrite, Written
from .engine.pool import DaemonThreadPool
from .engine.stage import HostCopier, StagingArena, needs_pinned
from .engine.unstaged import SourceWrite, writes_from_source
from .errors import ConfigError, DistributedCheckpointError, FormatError, SaveError
from .events import background_warning
from .format.jsonsafe import check_depth, dumps_canonical, is_finite_number
from .format.layout import MAX_STEP, align_up, is_valid_tag
from .format.manifest import Manifest
from .handle import SaveHandle
from .lazy import Guard
from .partdrain import PartDrains
from .references import CHAIN_STAT, Incremental, chain_of, check_holders, rank_base, wants_full
from .replicated import Selection, check_declaration, normalize_keys
from .savelayout import LayoutCache, first_prints
from .state import flatten
from .storage.base import Storage
from .storage.memory import MemoryStorage
from .tiers import TierChain, TierRuntime

if TYPE_CHECKING:  # pragma: no cover
    from .dist import CoordinationGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveRequest:
    """What a caller asked to record with a save, validated: see :meth:`validate`."""

    step: int
    metrics: dict[str, float]
    tags: tuple[str, ...]
    metadata: dict[str, Any]
    replicated: tuple[str, ...] = ()

    @classmethod
    def validate(
        cls,
        step: Any,
        metrics: Mapping[str, float] | None,
        tags: Iterable[str],
        metadata: Mapping[str, Any] | None,
        replicated: Iterable[str] = (),
    ) -> SaveRequest:
        """Check ``save()``'s arguments.

        Raises:
            ConfigError: a step outside ``[0, 2**63)``, a metric that is not a finite number, a malformed tag,
                metadata that is not plain JSON, or ``replicated`` that is not a list of keys.
        """
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
        return cls(int(step), metrics_d, tags_t, metadata_d, normalize_keys(replicated))


@dataclass
class PendingSave:
    """A save between staging and commit, handed from the caller's thread to the commit thread."""

    handle: SaveHandle
    request: SaveRequest
    job: StagedWrite
    prefix: str
    tree: Any
    started: float
    started_wall: float
    replicated: Selection | None = None  # the replicated tensors of a collective save
    base: int | None = None  # the step an incremental save references (pinned in the catalog until settled)
    manifest: Manifest | None = None  # set once committed (on rank 0 of a collective save)
    info: CheckpointInfo | None = None  # the committed checkpoint, as rank 0 described it (other ranks)
    staging: Future[None] | None = None  # a lazy save's background staging, done when every byte is staged
    drains: PartDrains | None = None  # a node-local first tier's drains to later tiers (decided in the vote)
    prints: dict[str, str] | None = None  # the replicated fingerprints this rank votes with (first async save)


def shard_cap(max_shard_bytes: int | None, incremental: bool) -> int | None:
    """``max_shard_bytes``; an incremental save also caps shards at one group of small tensors, so that
    every large tensor has a shard of its own, which a later save can reference on its own."""
    if not incremental:
        return max_shard_bytes
    return min(max_shard_bytes or GROUP_BYTES, GROUP_BYTES)


class Saver:
    """Stages saves into one staging arena and commits them on the first tier.

    Args:
        tier: the first tier (every save is written there).
        chunk_bytes: checksum and I/O chunk (validated by the caller).
        max_shard_bytes: start a new shard file past this many bytes (None: one shard).
        staging_bytes: the staging budget (None: one copy of the state, within the memory available).
        pool: the I/O threads that write the shards.
        log_event: records failed saves in the event log.
        group: the coordination group of a collective save (every rank saves its part of one checkpoint and
            rank 0 commits it once every rank voted yes), or None for a single process.
        incremental: reference the shards equal to the newest committed checkpoint's instead of writing them
            (docs/format.md section 9), with these options; None: write every save whole.

    Thread safety: :meth:`stage` on one caller thread at a time, :meth:`complete` on the commit thread.
    """

    def __init__(
        self,
        tier: TierRuntime,
        *,
        chunk_bytes: int,
        max_shard_bytes: int | None,
        staging_bytes: int | None,
        pool: DaemonThreadPool,
        log_event: Callable[[dict[str, Any]], None],
        group: CoordinationGroup | None = None,
        incremental: Incremental | None = None,
    ) -> None:
        self.group = group
        self.incremental = incremental
        self.rank = group.rank if group is not None else 0
        # A node-local first tier (memory on several nodes): each node holds its own ranks' shards; rank 0 checks
        # and commits over its node's, and every other node's leader commits the same manifest over its own.
        self.node_ranks: frozenset[int] | None = None
        self.node_leader = self.rank == 0
        if group is not None and isinstance(tier.storage, MemoryStorage) and group.identity.num_nodes > 1:
            me = group.identity
            self.node_ranks = frozenset(i.rank for i in group.identities if i.node_rank == me.node_rank)
            self.node_leader = me.local_rank == 0
            if incremental is not None:
                raise ConfigError("incremental=True is not supported on a memory tier spread over several nodes")
        self.storage: Storage = tier.storage
        self.catalog = tier.catalog
        self.commit = tier.commit
        self.chunk_bytes = chunk_bytes
        self.max_shard_bytes = max_shard_bytes
        self.arena = StagingArena(staging_bytes)
        self.copier = HostCopier()
        self.pool = pool
        self.log_event = log_event
        self.staging_step: int | None = None  # the step being staged on the caller's thread, if any
        self.abandoned_prefix: str | None = None  # the prefix of the last save that failed while staging
        self.last_total_s = 0.0  # the last committed save's time from start to commit
        self.checked_replicated: set[tuple[str, ...]] = set()  # declarations whose fingerprints agreed
        self.last_step: int | None = None  # the last step this Saver committed: the next incremental base
        self.force_full = False  # the next incremental save writes everything (its base lost a referenced step)
        self.announced_kept = 0  # collective: rank 0's kept_by_references, as its last commit told every rank
        self.guard = Guard()  # what lazy saves may stage after save_async returns (lazy.py)
        self.layouts = LayoutCache(self.rank, group.world_size if group is not None else 1)  # savelayout.py

    def close(self, *, release_memory: bool) -> None:
        if release_memory:  # else a lazy save may still be staging: its hooks stay until the process ends
            self.guard.close()
        self.copier.close()
        if release_memory:
            self.arena.release()

    def prepare(self, state: Any) -> None:
        """Allocate (and fault in) the staging memory that a save of ``state`` needs."""
        flat = flatten(state)
        padded = sum(align_up(t.nbytes) for t in flat.tensors)
        chunk = self.chunk_for(padded)
        pinned = needs_pinned([t.source for t in flat.tensors])
        self.arena.reserve(padded, pinned=pinned, min_bytes=min(2 * chunk, padded))

    def chunk_for(self, padded_bytes: int) -> int:
        """The chunk size for a save of ``padded_bytes`` (tensors padded to 4 KiB): the configured one,
        unless the state streams through a smaller staging budget; then at most half the budget, so
        staging and writing overlap."""
        budget = self.arena.budget_for(padded_bytes)
        if budget >= padded_bytes:
            return self.chunk_bytes
        return min(self.chunk_bytes, max(4096, (budget // 2) // 4096 * 4096))

    # -- caller's thread --------------------------------------------------------------------------

    def check_replicated(self, request: SaveRequest, state: Any, serial: Executor, blocking: bool = True) -> None:
        """The first collective save declaring ``request.replicated`` checks that every rank holds that state
        identically. A blocking one here, on the ``serial`` executor (the commit thread: this exchange keeps its
        place among earlier saves' votes), raising ConfigError on every rank before anything is written; an
        async one in its vote (:meth:`stage` fingerprints, rank 0 compares: savelayout.first_prints)."""
        keys = request.replicated
        if self.group is None or not keys or keys in self.checked_replicated:
            return
        if self.node_ranks is not None:  # a replicated tensor would lie in one node's memory only
            raise ConfigError(
                "replicated= is not supported with a memory first tier on several nodes: each node's memory must "
                "hold every tensor its ranks restore; save without replicated= (peer replicas cover node loss)"
            )
        if not blocking:
            return
        serial.submit(check_declaration, self.group, state, keys, request.step).result()
        self.checked_replicated.add(keys)

    def stage(
        self,
        handle: SaveHandle,
        request: SaveRequest,
        state: Any,
        started: float,
        started_wall: float,
        blocking: bool,
        token: str | None = None,
        lazy: bool = False,
    ) -> PendingSave:
        """Flatten, lay out and stage ``state`` under the attempt ``token`` (the ranks of a collective save
        agree on it; None: a fresh one). On failure nothing is visible and the error is raised. ``lazy``:
        stage only the tensors no guard covers now, the rest in the background (lazy.py)."""
        stats = handle.stats
        prefix: str | None = None
        job: StagedWrite | None = None
        base: Manifest | None = None
        staging: Future[None] | None = None
        prints: dict[str, str] | None = None
        if lazy:
            self.guard.check(blocking=blocking, collective=self.group is not None)
        self.staging_step = request.step
        try:
            lay = self.layouts.layout(
                state,
                request.replicated,
                collective=self.group is not None,
                chunk_for=self.chunk_for,
                max_shard_bytes=shard_cap(self.max_shard_bytes, self.incremental is not None),
            )
            stats.flatten_s = time.perf_counter() - started  # with the layout: the time before any copy
            stats.extra["layout_reused"] = lay.reused
            flat, sel, plan, sources = lay.flat, lay.selection, lay.plan, lay.sources  # no object per tensor
            if self.group is not None and not blocking:
                prints = first_prints(state, flat, request.replicated, self.checked_replicated)
            prefix = self.commit.begin(request.step, token)
            io_before = _io_bytes(self.storage)
            increment = None
            if self.incremental is not None:
                base = self._pin_base(request.step, self.incremental.full_every)
                world = self.group.world_size if self.group is not None else 1
                increment = Increment(self.storage, plan, rank_base(base, self.rank, world))
                stats.extra[CHAIN_STAT] = chain_of(increment.base)  # None: a base hashed otherwise
            addresses = lay.addresses
            if blocking and not lazy and increment is None and writes_from_source(self.storage, sources, addresses):
                # the caller waits until durable and the page cache copy is the snapshot: no staging copy
                job = SourceWrite(self.storage, prefix, plan, sources, self.pool, addresses)
                stats.extra["unstaged"] = True
            else:
                job = StagedWrite(
                    self.storage,
                    prefix,
                    plan,
                    sources,
                    self.arena,
                    self.pool,
                    self.copier,
                    increment=increment,
                    addresses=addresses,
                )
            if lazy:
                staging = self.guard.start(job, lay.tensors, request.step, stats)
            if staging is None:
                job.stage(overlap=blocking)  # async: shortest stall; blocking: shortest time to durable
        except BaseException as exc:
            if job is not None:
                job.abort()
            if base is not None:
                self.catalog.pins.unpin(base.step)
            if prefix is not None and self.group is None:  # a shared prefix: rank 0 removes it after the vote
                _abort_prefix(self.commit, prefix)
            self.abandoned_prefix = prefix
            self.force_full = self.force_full or (self.group is not None and self.incremental is not None)  # _failed
            handle._set_error(exc)
            handle._observed = True  # raised right here, to the caller
            self.log_event({"step": request.step, "outcome": "failed", "time": started_wall, "error": str(exc)})
            raise
        finally:
            self.staging_step = None
        if not job.pinned and staging is None:
            handle._set_staged()  # CPU copies are done; device copies are confirmed by the commit thread
        stats.stage_s = job.stage_s
        stats.stage_wait_s = job.ring.waited_s
        stats.tensor_bytes = sum(plan.nbytes)  # this rank's: replicated tensors count once
        stats.stored_bytes = plan.total_bytes
        stats.num_tensors = len(sources)
        stats.blocked_s = time.perf_counter() - started
        stats.extra["io_before"] = io_before
        b = base.step if base is not None else None
        return PendingSave(
            handle, request, job, prefix, flat.tree, started, started_wall, sel, b, staging=staging, prints=prints
        )

    def _pin_base(self, step: int, full_every: int | None) -> Manifest | None:
        """The checkpoint an incremental save of ``step`` references, pinned until the save settles; None
        for a full save (none yet, or ``full_every`` reached)."""
        if self.force_full:
            self.force_full = False
            return None
        base = self.catalog.pin(self.last_step)  # after the first save, no listing on the caller's thread
        kept = self.announced_kept if self.group is not None else self.catalog.kept_by_references  # see _announced
        if base is not None and (base.step >= step or wants_full(base, full_every, kept)):
            self.catalog.pins.unpin(base.step)
            return None
        return base

    # -- commit thread ----------------------------------------------------------------------------

    def complete(self, p: PendingSave) -> bool:
        """Wait for the writes, make them durable and commit (``p.manifest`` is then set, on rank 0 of a
        collective save). Returns False after a failure, which is then stored on the handle (and in the event
        log) and leaves nothing visible."""
        try:
            return self._complete(p)
        finally:
            if p.base is not None:  # committed: its manifest now keeps the base; failed: nothing needs it
                self.catalog.pins.unpin(p.base)

    def _complete(self, p: PendingSave) -> bool:
        handle, stats = p.handle, p.handle.stats
        try:
            if p.staging is not None:  # a lazy save: its staging ends in the background
                p.staging.result()
                stats.stage_s = p.job.stage_s
            p.job.wait_staged()
            handle._set_staged()
            written = p.job.finish(lambda name: self.commit.shard_file(p.prefix, name), rank=self.rank)
        except BaseException as exc:
            p.job.abort()
            return self._failed(p, _vote_no(self.group, p.request.step, exc) if self.group is not None else exc)
        stats.write_s = time.perf_counter() - p.started - stats.flatten_s
        if p.job.increment is not None:  # compared: found unchanged in the staging memory, so never hashed
            stats.extra["referenced_bytes"] = p.job.increment.referenced_bytes
            stats.extra["compared_bytes"] = p.job.increment.compared_bytes
        before = stats.extra.pop("io_before", None)
        after = _io_bytes(self.storage)
        if before is not None and after is not None:  # bytes per I/O path (direct, buffered...)
            stats.extra["io"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
        stats.total_s = time.perf_counter() - p.started
        try:
            if self.group is None:
                self._commit_alone(p, written)
            else:
                self._vote(p, written)
        except BaseException as exc:
            if p.manifest is None:  # never remove what a commit made visible
                if self.group is None:
                    p.job.abort()
                return self._failed(p, exc)
            log.warning("step %d is committed, but the ranks could not all be told: %s", p.request.step, exc)
        stats.total_s = time.perf_counter() - p.started
        self.last_total_s = stats.total_s
        return True

    def _failed(self, p: PendingSave, exc: BaseException) -> bool:
        """Clean up a failed save and store its error. The attempt's prefix is removed by its owner: the
        process itself, or rank 0 of a collective save once every rank has cleaned up its own part."""
        self._settle(p.request.step)
        if self.group is not None and self.incremental is not None:
            self.force_full = True  # the base may have lost a referenced step: every rank that saw this starts over
        if self.rank == 0 or (self.node_ranks is not None and self.node_leader):
            _abort_prefix(self.commit, p.prefix)
        failed = {"step": p.request.step, "outcome": "failed", "time": p.started_wall, "error": str(exc)}
        self.log_event({**failed, **p.handle.stats.to_json()})
        p.handle._set_error(exc)
        return False

    def _commit_alone(self, p: PendingSave, written: Written) -> None:
        request, stats = p.request, p.handle.stats
        t_commit = time.perf_counter()
        manifest = Manifest(
            step=request.step,
            shards=written.shards,
            tensors=written.tensors,
            tree=p.tree,
            chunk_bytes=written.chunk_bytes,
            metrics=request.metrics,
            tags=request.tags,
            metadata=request.metadata,
            stats=stats.to_json(),
            content_hash=written.content_hash,
        )
        if p.base is not None:
            try:
                check_holders(self.storage, manifest)
            except SaveError:
                self.last_step = None  # the base's chain is broken: the next save lists the root, and is full
                self.force_full = True
                raise
        self.commit.commit(p.prefix, request.step, manifest.to_json())
        p.manifest = manifest  # only now: a failed commit leaves nothing visible, and is cleaned up
        stats.commit_s = time.perf_counter() - t_commit
        if self.incremental is not None:
            self.last_step = request.step

    def _vote(self, p: PendingSave, written: Written) -> None:
        """Collective save: vote yes with this rank's part; rank 0 merges the parts and commits if all voted
        yes. Raises DistributedCheckpointError (on every rank) if any rank failed or the commit did."""
        assert self.group is not None
        request, stats = p.request, p.handle.stats
        phases: dict[str, float] = {}

        def commit(parts: list[Any]) -> Any:
            t_commit = time.perf_counter()
            manifest, data = global_manifest(
                request.step,
                parts,
                phases,
                chunk_bytes=written.chunk_bytes,
                metrics=request.metrics,
                tags=request.tags,
                metadata=request.metadata,
                stats=stats.to_json(),
            )
            check_shards_visible(self.storage, p.prefix, manifest, self.node_ranks)
            if manifest.referenced_steps:  # the ranks' references, parsed as any reader will, and still held
                Manifest.parse(data, path=f"step {request.step}", expect_step=request.step)
                check_holders(self.storage, manifest)
            t_write = time.perf_counter()
            self.commit.commit(p.prefix, request.step, data)
            phases["write_s"] = time.perf_counter() - t_write
            p.manifest = manifest
            stats.commit_s = time.perf_counter() - t_commit
            info = CheckpointInfo.from_manifest(manifest, self.catalog.location(request.step))
            # stats: so no other rank reads the global manifest back; kept_by_references: see _announced
            result = {**info.to_json(), "stats": info.stats, "kept_by_references": self.catalog.kept_by_references}
            if self.node_ranks is not None:  # every node's leader commits it over its own node's shards
                result["manifest"] = data.decode()
                if p.drains is not None:  # and drains its part to the later tiers rank 0 chose
                    result["drains"] = p.drains.decide(request.step)
            return result

        t_part = time.perf_counter()
        try:
            part = rank_part(
                self.rank, written.shards, written.tensors, p.tree, p.replicated, written.content_hash, p.prints
            )
        except Exception as exc:  # vote no with it: the other ranks must not wait for this rank's vote
            raise _vote_no(self.group, request.step, exc) from exc
        phases["part_s"] = time.perf_counter() - t_part
        outcome = self.group.vote(request.step, part, commit=commit if self.rank == 0 else None)
        stats.extra["vote"] = {**self.group.last_timing, **phases}  # who waited for whom, and rank 0's commit
        if p.prints is not None:  # every rank's fingerprints agreed (rank 0 committed only then)
            self.checked_replicated.add(request.replicated)
        if self.incremental is not None:
            self.last_step, self.announced_kept = request.step, _announced(outcome.result)
        if self.rank != 0:
            p.info = CheckpointInfo.from_json(outcome.result)  # type: ignore[arg-type]
            if self.node_ranks is not None and self.node_leader:
                self._commit_node(p, outcome.result)
                if p.drains is not None:
                    p.drains.told(request.step, outcome.result, committed=p.manifest is not None)

    def _commit_node(self, p: PendingSave, result: Any) -> None:
        """A node leader of a node-local tier, after rank 0 committed: commit the global manifest over this
        node's shards. A failure here loses this node's copy only (a warning says so); the step is committed."""
        step = p.request.step
        try:
            text = result.get("manifest") if isinstance(result, dict) else None
            if not isinstance(text, str):
                raise FormatError(f"step {step}: rank 0 sent no manifest for this node's copy")
            data = text.encode()
            manifest = Manifest.parse(data, path=f"rank 0's manifest of step {step}", expect_step=step)
            check_shards_visible(self.storage, p.prefix, manifest, self.node_ranks, rank=self.rank)
            self.commit.commit(p.prefix, step, data)
        except Exception as exc:
            _abort_prefix(self.commit, p.prefix)
            background_warning(
                f"step {step} is committed, but this node's copy in {self.storage.uri} could not be: {exc}; "
                "its ranks restore it from a peer's replica or another tier"
            )
            return
        p.manifest = manifest

    def vote_no(self, step: int, exc: BaseException, prefix: str | None = None) -> None:
        """Commit thread, after this rank failed to stage ``step`` (its caller got the error; ``stage`` made the next
        save full): vote no, so every other rank fails now, not at its timeout; rank 0 then removes ``prefix``."""
        if self.group is not None:
            _vote_no(self.group, step, exc)
        self._settle(step)
        if prefix is not None and self.rank == 0:
            _abort_prefix(self.commit, prefix)

    def _settle(self, step: int) -> None:
        """After a failed collective save: one more exchange, entered by each rank once its own cleanup is
        done, so that rank 0 removes the shared prefix only when no rank still touches it. Skipped when the
        group is broken (a rank died: its part is a leftover for the next prune)."""
        if self.group is None or self.group.poisoned:
            return
        try:
            self.group.all_gather_json(None, step=step)
        except BaseException as exc:
            log.warning("step %d: the ranks could not settle after a failed save: %s", step, exc)


def _announced(result: Any) -> int:
    """The steps rank 0's retention kept for references alone, as its commit outcome tells every rank. Every
    rank bounds its chain on this one figure, so all go full at the same save: a rank that alone went full
    would leave the other ranks' chains, and with them every step, kept (references.MAX_KEPT_BY_REFERENCES)."""
    kept = result.get("kept_by_references") if isinstance(result, dict) else None
    return kept if type(kept) is int and kept >= 0 else 0


def _vote_no(group: CoordinationGroup, step: int, exc: BaseException) -> BaseException:
    """Vote no. Returns the error every rank raises (naming this rank), or ``exc`` if the group is broken."""
    try:
        group.vote(step, error=exc)
    except DistributedCheckpointError as failure:
        return failure
    except BaseException:  # the group itself is broken: report the rank's own error
        return exc
    return exc  # pragma: no cover (a no vote always raises)


def _abort_prefix(commit: CommitStrategy, prefix: str) -> None:
    try:
        commit.abort(prefix)
    except Exception:  # keep the original error; prune removes what is left
        log.warning("could not remove %s after a failed save", prefix, exc_info=True)


def _io_bytes(storage: Storage) -> dict[str, int] | None:
    """Bytes the storage moved per I/O path so far (storages with I/O statistics only), and under
    ``"writeback"`` the buffered bytes whose writeback it started early."""
    io_stats = getattr(storage, "io_stats", None)
    if io_stats is None:
        return None
    moved: dict[str, int] = io_stats.bytes_by_path()
    early = getattr(io_stats, "writeback", None)
    if early is not None and early.bytes:
        moved["writeback"] = early.bytes
    return moved


def complete_and_follow(saver: Saver, chain: TierChain, pending: PendingSave) -> None:
    """Commit thread: commit on the first tier, then (on rank 0) the chain's follow-up: drains, retention."""
    pending.drains = partdrain.of(chain)
    if not saver.complete(pending):
        return
    if pending.manifest is not None and saver.rank == 0:
        chain.after_commit(pending.handle, pending.manifest, pending.started_wall)
        return
    if pending.manifest is not None:  # another node's leader: its node's memory tier holds the step too
        chain.after_node_commit(pending.handle, pending.manifest)
    if pending.info is not None:  # another rank: rank 0 committed the global manifest and described it
        pending.handle._set_result(pending.info)
