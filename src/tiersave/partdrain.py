"""Drains of a memory tier spread over several nodes: each node copies its own part, rank 0 commits the whole.

A collective Checkpointer whose first tier is ``mem://`` on several nodes holds each node's ranks' shards in
that node's memory only, so no single process can copy a checkpoint to a later (shared) tier. Here:

- Cadence (:meth:`PartDrains.decide`): rank 0 decides, inside the vote of each save (on the commit thread),
  which later tiers the step goes to (``every``, ``every_s``; a tier whose previous drain is still running
  skips the step); the decision travels to every node leader with the vote's outcome, so every node drains
  the same steps, with no exchange of its own.
- Part drain (:meth:`PartDrains._drain`, on each node leader's drain thread of that tier): the node's shards are
  copied, chunk by chunk against their CRC-32C (``drain.copy_shards``), into an attempt prefix that every node
  derives alike from the job and the step (``Collective.derived_token``: no collective from a drain thread,
  whose group the training thread votes on); then a "part durable" record (``part-node-<n>.json``, one atomic
  put) names the shards and sizes written, or the error that stopped the node.
- Commit (rank 0's drain, after its own part): it waits for every other node's record, within the
  coordination timeout plus a transfer allowance (one listing of the attempt per round, backing off; ``close()``
  ends the wait at once); a node that reports an error or does not report fails the drain with an error naming
  it; otherwise every shard of the global manifest must be reported with its size, and be on the tier at that
  size (a record proves nothing about the bytes), before the manifest is committed with the tier's own protocol
  (rename, or a create-only put). A failed attempt, even one rank 0 failed before touching (its name is
  derived, not stored), is removed by rank 0, and again after the tier's next commit (a node that was only slow
  may have written to it meanwhile; by then every node has finished it). An attempt rank 0 never got to remove
  (its process died) carries rank 0's pid and host like any attempt: invisible (no manifest), and removed by the
  leftover cleanup of retention or ``tiersave prune`` (docs/tiers.md).
- Rank 0 runs the tier's retention after each commit, before it decides the next step for that tier (so its
  leftover pass never meets an attempt the nodes are writing); the other nodes never delete anything there.

Scope: the cadence decision, the per-node part copy, the records and the global commit of a later tier of a
node-local memory tier. Anti-scope: moving and checking bytes (drain.py), the save and its vote (saving.py),
the single-process drains of the chain (tiers.py), the peer replicas (replication.py).

Thread safety: :meth:`decide`, :meth:`told` and :meth:`after_commit` run on the commit thread; each later tier's
part drains run on that tier's own drain thread (node leaders only).
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ._crash import crashpoint
from ._futures import running_future
from .catalog import CheckpointInfo
from .commit import check_shards_visible
from .drain import copy_shards, destination_names
from .engine.pool import DaemonThreadPool
from .errors import (
    ClosedError,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FormatError,
    ObjectNotFoundError,
    SaveTimeoutError,
    TiersaveError,
)
from .events import background_warning, drained_event
from .format.layout import MANIFEST_NAME, step_dirname
from .format.manifest import Manifest

if TYPE_CHECKING:  # pragma: no cover
    from .collective import Collective
    from .handle import SaveHandle
    from .storage.base import Storage
    from .tiers import TierChain, TierRuntime

__all__ = ["PartDrains", "of", "read_record", "record_name"]

RECORD_PREFIX = "part-node-"
_RECORD_MAX_BYTES = 1 << 20
_POLL_S = (0.05, 1.5, 2.0)  # rank 0's wait for the records: first pause, growth per round, longest pause
_DRAIN_GBPS = 0.05  # the slowest part drain allowed before rank 0 gives up on a node (on top of the timeout)


def record_name(node: int) -> str:
    """The "part durable" record of ``node`` in an attempt prefix: ``part-node-00001.json``."""
    return f"{RECORD_PREFIX}{node:05d}.json"


class PartDrains:
    """The drains to the later tiers of a chain whose first tier is a memory tier on several nodes (one of the
    chain's companions; every rank has one, node leaders drain). Built on every rank, in the same order.

    Args:
        chain: the Checkpointer's chain; its later tiers' own drains are turned off (they would copy only
            rank 0's node's part).
        collective: the job's collective (identities, the timeout, the attempt tokens).

    Raises:
        ConfigError: a later tier with ``compress=`` or ``incremental=`` (not supported on part drains yet).
    """

    def __init__(self, chain: TierChain, collective: Collective) -> None:
        group = collective.group
        me = group.identity
        self.chain = chain
        self.collective = collective
        self.node = me.node_rank
        self.leader = me.local_rank == 0
        self.coordinator = group.rank == 0
        self.timeout_s = group.timeout_s
        self.ranks: dict[int, set[int]] = {}
        for ident in group.identities:
            self.ranks.setdefault(ident.node_rank, set()).add(ident.rank)
        if self.coordinator and not self.leader:
            raise ConfigError(
                "a memory tier on several nodes with later tiers needs rank 0 to be local rank 0 of its node "
                f"(torchrun's placement); this rank 0 has local rank {me.local_rank}"
            )
        self.tiers = chain.tiers[1:]
        for tier in self.tiers:
            options = [
                o
                for o, on in (("compress", tier.spec.compress is not None), ("incremental", tier.spec.incremental))
                if on
            ]
            if options:
                raise ConfigError(
                    f"{'= and '.join(options)}= on tier {tier.name} is not supported after a memory tier on "
                    f"{len(self.ranks)} nodes (each node drains its own part); leave it out"
                )
        self._pools: dict[str, DaemonThreadPool] = {}
        for tier in self.tiers:  # the chain's own drain would copy rank 0's node's part only
            tier.drained_elsewhere(copies=self.leader)
            if self.leader:
                self._pools[tier.name] = DaemonThreadPool(1, f"tiersave-part-{tier.name}")
        self._lock = threading.Lock()
        self._closing = threading.Event()  # set by close(): rank 0 stops waiting for the nodes' records
        self._decided: dict[int, builtins.list[str]] = {}  # step -> tiers to drain it to (until after_commit)
        self._busy: dict[str, Future[None]] = {}  # rank 0: each tier's drain task (its retention included)
        self._aborted: dict[str, builtins.list[str]] = {}  # rank 0: failed attempts a slow node may still write to

    # -- the decision (commit thread) --------------------------------------------------------------

    def decide(self, step: int) -> dict[str, Any]:
        """Rank 0, in the vote of ``step`` once it is committed in memory: the later tiers it drains to, as sent
        to every node leader with the vote's outcome. A tier still draining an earlier step skips this one."""
        now = time.monotonic()
        chosen: builtins.list[str] = []
        for tier in self.tiers:
            if not tier.due(now):
                continue
            busy = self._busy.get(tier.name)
            if busy is not None and not busy.done():
                tier.skipped += 1
                self.chain.log(
                    {
                        "step": step,
                        "tier": tier.name,
                        "outcome": "drain_skipped",
                        "time": time.time(),
                        "reason": "the nodes are still draining an earlier step",
                    }
                )
                background_warning(
                    f"step {step} is not sent to tier {tier.name} ({tier.storage.uri}): the nodes are still draining "
                    f"an earlier step there ({tier.skipped} skipped so far); the next due save is sent"
                )
                continue
            chosen.append(tier.name)
            tier.last_sent_mono = now
        with self._lock:
            self._decided[step] = chosen
        return {"tiers": chosen}

    def told(self, step: int, outcome: Any, *, committed: bool) -> None:
        """Another node's leader, after the vote of ``step``: remember the tiers rank 0 chose (``outcome`` is the
        vote's result). When this node's memory copy could not be committed, its part cannot be drained: each
        chosen tier gets a record saying so at once, so rank 0 fails that drain now rather than at its timeout."""
        plan = outcome.get("drains") if isinstance(outcome, dict) else None
        names = plan.get("tiers") if isinstance(plan, dict) else None
        known = {t.name for t in self.tiers}
        chosen = [n for n in names if isinstance(n, str) and n in known] if isinstance(names, list) else []
        if committed:
            with self._lock:
                self._decided[step] = chosen
            return
        for name in chosen:
            tier = self.chain.get(name)
            reason = f"node {self.node}'s memory copy of step {step} could not be committed"
            self._pools[name].submit(self._report_error, tier, step, reason)

    def after_commit(self, handle: SaveHandle, chain: TierChain) -> None:
        """Commit thread of a node leader, once ``handle``'s step is in its memory: start its part drain to each
        tier chosen for the step. ``handle.tiers[name]`` reports it: on rank 0 the commit of the whole step there,
        on another node's leader the durability of its node's part."""
        with self._lock:
            chosen = self._decided.pop(handle.step, [])
            for old in [s for s in self._decided if s < handle.step]:  # a step whose copy failed: never started
                del self._decided[old]
        if not self.leader:
            return
        for name in chosen:
            tier = chain.get(name)
            future: Future[CheckpointInfo | None] = running_future()
            handle.tiers[tier.name] = future
            chain.protection.hold(0, handle.step)  # the memory tier's retention must not delete the source
            tier.sent += 1
            try:
                task = self._pools[name].submit(self._drain, tier, handle.step, future)
            except BaseException as exc:  # never leave the handle's tier (or rank 0's next decision) waiting
                chain.protection.release(0, handle.step)
                self._busy.pop(tier.name, None)
                future.set_exception(exc)
                raise
            if self.coordinator:  # the task, not the handle's future: busy until its retention has run too
                self._busy[tier.name] = task

    # -- the drain (each tier's drain thread, node leaders) ------------------------------------------

    def _token(self, tier: TierRuntime, step: int) -> str:
        return self.collective.derived_token(f"drain/{tier.name}/{step}")

    def _prefix(self, tier: TierRuntime, step: int) -> str:
        """The attempt prefix every node derives alike for ``step`` on ``tier`` (checked not committed there)."""
        return tier.commit.begin(step, self._token(tier, step))

    def attempt(self, tier: TierRuntime, step: int) -> str:
        """The name of that prefix, with no I/O: what rank 0 removes when it failed before :meth:`_prefix` (the
        other nodes may have written there all the same): the tier's commit names it, as in its ``begin``."""
        return tier.commit.prefix_of(step, self._token(tier, step))

    def _drain(self, tier: TierRuntime, step: int, future: Future[CheckpointInfo | None]) -> None:
        started, started_wall = time.perf_counter(), time.time()
        prefix: str | None = None
        try:
            try:
                crashpoint("part_drain_start")
                prefix = self._prefix(tier, step)
                manifest = self.chain.first.catalog.manifest(step)
                mine = [i for i, s in enumerate(manifest.shards) if s.rank in self.ranks[self.node]]
                assert tier.copier is not None
                written = copy_shards(
                    self.chain.first.catalog,
                    tier.storage,
                    manifest,
                    prefix,
                    mine,
                    executor=tier.copier,
                    io_threads=tier.io_threads,
                )
                crashpoint("part_drain_written")
                if not self.coordinator:
                    self._put(tier, prefix, {"node": self.node, "step": step, "shards": written})
                    tier.commit.hand_over(prefix)  # rank 0 commits or removes it
            finally:
                self.chain.protection.release(0, step)
            info = self._commit(tier, step, manifest, prefix, written) if self.coordinator else None
        except BaseException as exc:
            self._failed(tier, step, prefix, exc, started_wall, future)
            return
        seconds = time.perf_counter() - started
        tier.last_drain_s = seconds
        nbytes = sum(written.values())
        stored = info.stored_bytes if info is not None else nbytes
        self.chain.log(
            {
                "step": step,
                "tier": tier.name,
                "outcome": "drained",
                "time": started_wall,
                "node": self.node,
                **drained_event(seconds, stored, stored, written_bytes=nbytes),
            }
        )
        try:
            if self.coordinator:  # before the result: a save made once tier_result() returned finds the tier idle
                self._sweep(tier)
                self.chain.retain(tier, tier.policy, leftovers=True)
        finally:
            future.set_result(info)

    def _sweep(self, tier: TierRuntime) -> None:
        """Rank 0, after a commit on ``tier``: remove the failed attempts again. A node that was only slow may
        have written its part there after rank 0 gave up; but every node has now reported a later step, and a
        node drains one step at a time, so none writes to them any more."""
        for prefix in self._aborted.pop(tier.name, []):
            try:
                tier.commit.abort(prefix)
            except Exception as exc:  # retention's leftover pass gets it once rank 0's process has ended
                background_warning(f"could not remove the failed attempt {prefix} from {tier.storage.uri}: {exc}")

    def _failed(
        self,
        tier: TierRuntime,
        step: int,
        prefix: str | None,
        exc: BaseException,
        started_wall: float,
        future: Future[CheckpointInfo | None],
    ) -> None:
        """A node's part (or rank 0's commit) failed: another node tells rank 0 with its record; rank 0 removes
        the attempt. Either way the step is not on ``tier`` and a warning says why."""
        if self.coordinator:  # even before rank 0 began it: the other nodes may have written their parts there
            where = prefix if prefix is not None else self.attempt(tier, step)
            self._aborted.setdefault(tier.name, []).append(where)
            try:
                tier.commit.abort(where)
            except Exception as cleanup:
                background_warning(f"could not remove {where} from {tier.storage.uri}: {cleanup}")
        else:
            self._report_error(tier, step, str(exc), prefix)
        self.chain.log(
            {"step": step, "tier": tier.name, "outcome": "drain_failed", "time": started_wall, "error": str(exc)}
        )
        what = "the drain" if self.coordinator else f"node {self.node}'s part of the drain"
        background_warning(
            f"{what} of step {step} to tier {tier.name} ({tier.storage.uri}) failed: {exc}; the step is not on "
            f"{tier.name} (the earlier ones there are unchanged), and it is still in the nodes' memory"
        )
        future.set_exception(exc)

    def _report_error(self, tier: TierRuntime, step: int, reason: str, prefix: str | None = None) -> None:
        try:
            where = prefix if prefix is not None else self._prefix(tier, step)
            try:
                self._put(tier, where, {"node": self.node, "step": step, "error": reason})
            finally:
                tier.commit.hand_over(where)  # rank 0 removes it
        except Exception as exc:  # rank 0 then names this node at its timeout
            background_warning(f"node {self.node} could not tell rank 0 that its part of step {step} failed: {exc}")

    def _put(self, tier: TierRuntime, prefix: str, record: dict[str, Any]) -> None:
        tier.storage.put(f"{prefix}/{record_name(self.node)}", json.dumps(record).encode(), mode="create")

    # -- the commit (rank 0) ----------------------------------------------------------------------

    def _commit(
        self, tier: TierRuntime, step: int, manifest: Manifest, prefix: str, mine: dict[str, int]
    ) -> CheckpointInfo:
        """Wait for every other node's record, check that the parts make the whole checkpoint, commit it."""
        reports = {self.node: mine, **self._wait_for_parts(tier, step, prefix, manifest.stored_bytes)}
        names = destination_names(manifest)
        node_of = {r: n for n, ranks in self.ranks.items() for r in ranks}
        shards = []
        for name, shard in zip(names, manifest.shards, strict=True):
            node = node_of.get(shard.rank)
            got = reports.get(node, {}) if node is not None else {}
            if got.get(name) != shard.size:
                raise CorruptCheckpointError(
                    f"step {step} on {tier.storage.uri}: node {node} reported shard {name} of rank {shard.rank} as "
                    f"{got.get(name)!r} bytes, expected {shard.size}",
                    step=step,
                    file=name,
                )
            shards.append(dataclasses.replace(shard, file=tier.commit.shard_file(prefix, name)))
        whole = dataclasses.replace(manifest, shards=tuple(shards))
        self._check_visible(tier, prefix, whole)
        for node in reports:  # the records are not part of the checkpoint
            if node != self.node:
                tier.storage.delete(f"{prefix}/{record_name(node)}")
        data = whole.to_json()
        location = f"{tier.storage.uri.rstrip('/')}/{step_dirname(step)}"
        committed = Manifest.parse(data, path=f"{location}/{MANIFEST_NAME}", expect_step=step)
        tier.commit.commit(prefix, step, data)
        return CheckpointInfo.from_manifest(committed, location)

    def _check_visible(self, tier: TierRuntime, prefix: str, whole: Manifest) -> None:
        """Every node's shards are on the tier at their sizes, as the commit will name them: a record says what a
        node wrote, not that it is still there (deleted, truncated, or written where rank 0 does not look).

        Raises:
            DistributedCheckpointError: naming the node, its ranks and the file.
        """
        for node, ranks in sorted(self.ranks.items()):
            try:
                check_shards_visible(tier.storage, prefix, whole, ranks)
            except CorruptCheckpointError as exc:
                message = (
                    f"the drain of step {whole.step} to tier {tier.name} ({tier.storage.uri}) found node {node}'s "
                    f"part incomplete: shard {exc.file} of its ranks {sorted(ranks)} is missing or has another size "
                    "than its record gives it; nothing is committed and the attempt is discarded"
                )
                raise DistributedCheckpointError(message, {r: exc for r in sorted(ranks)}) from exc

    def _reported(self, tier: TierRuntime, prefix: str) -> set[int]:
        """The nodes whose record is in the attempt now: one listing per round, not one read per node."""
        nodes = set()
        for info in tier.storage.list(prefix):
            name = info.key.rsplit("/", 1)[-1]
            digits = name[len(RECORD_PREFIX) : -len(".json")]
            if name.startswith(RECORD_PREFIX) and name.endswith(".json") and digits.isdigit():
                nodes.add(int(digits))
        return nodes

    def _wait_for_parts(self, tier: TierRuntime, step: int, prefix: str, nbytes: int) -> dict[int, dict[str, int]]:
        """Each other node's reported shards, once all have reported: the attempt is listed, less and less
        often, until every record is there, the time allowed is up, or :meth:`close` is called.

        Raises:
            DistributedCheckpointError: a node reported an error, or did not report in time (naming it).
            ClosedError: the Checkpointer was closed meanwhile.
        """
        limit = self.timeout_s + nbytes / (_DRAIN_GBPS * 1e9)
        deadline = time.monotonic() + limit
        pending = sorted(n for n in self.ranks if n != self.node)
        got: dict[int, dict[str, int]] = {}
        pause, growth, longest = _POLL_S
        while True:
            reported = self._reported(tier, prefix)
            for node in [n for n in pending if n in reported]:
                record = read_record(tier.storage, prefix, node, step)
                if record is None:  # listed, then gone: only rank 0 deletes records, so not yet visible to a read
                    continue
                if isinstance(record, str):
                    raise DistributedCheckpointError(
                        f"the drain of step {step} to tier {tier.name} ({tier.storage.uri}) failed on node {node}: "
                        f"{record}",
                        {r: TiersaveError(record) for r in sorted(self.ranks[node])},
                    )
                got[node] = record
                pending.remove(node)
            if not pending:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                missing = ", ".join(f"node {n} (ranks {sorted(self.ranks[n])})" for n in pending)
                message = (
                    f"the drain of step {step} to tier {tier.name} ({tier.storage.uri}) got no part from {missing} "
                    f"within {limit:.0f} s (killed, hung, or not sharing this tier with rank 0?); the attempt is "
                    "discarded"
                )
                raise DistributedCheckpointError(
                    message, {r: SaveTimeoutError(message) for n in pending for r in sorted(self.ranks[n])}
                )
            if self._closing.wait(min(pause, left)):
                raise ClosedError(
                    f"the drain of step {step} to tier {tier.name} ({tier.storage.uri}) was abandoned: the "
                    f"Checkpointer was closed while rank 0 waited for node(s) {pending}; the attempt is discarded"
                )
            pause = min(pause * growth, longest)

    # -- the Companion protocol -----------------------------------------------------------------------

    def pools(self) -> builtins.list[DaemonThreadPool]:
        return list(self._pools.values())

    def follow_up(self, first: Any) -> str:
        return "the drain of this node's part to later tiers, which lack the step it copies"

    def close(self, wait: bool = True) -> None:
        """Stop: a wait for the nodes' records ends at once (the Checkpointer waited for the drains first, as long
        as it was asked to); with ``wait``, the drain threads are joined."""
        self._closing.set()
        for pool in self._pools.values():
            pool.shutdown(wait=wait)


def read_record(storage: Storage, prefix: str, node: int, step: int) -> dict[str, int] | str | None:
    """Node ``node``'s "part durable" record of ``step`` in the attempt ``prefix``: its shards and their sizes,
    its error (a string), or None while it is absent. Parsed defensively: a malformed record is reported as
    that node's error, never trusted."""
    key = f"{prefix}/{record_name(node)}"
    try:
        data = storage.get(key, max_bytes=_RECORD_MAX_BYTES)
    except ObjectNotFoundError:
        return None
    except FormatError as exc:
        return f"its record {key} is unreadable: {exc}"
    try:
        record = json.loads(data)
    except ValueError as exc:
        return f"its record {key} is not JSON: {exc}"
    if not isinstance(record, dict) or record.get("node") != node or record.get("step") != step:
        return f"its record {key} is not node {node}'s record of step {step}"
    if "error" in record:
        return str(record["error"])
    shards = record.get("shards")
    if not isinstance(shards, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in shards.items()
    ):
        return f"its record {key} lists no valid shards"
    return shards


def of(chain: TierChain) -> PartDrains | None:
    """The part drains of ``chain``, if its first tier is a memory tier on several nodes with later tiers."""
    return next((c for c in chain.companions if isinstance(c, PartDrains)), None)
