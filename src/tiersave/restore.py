"""Restore a checkpoint: choose the step and the tier to read, then read one copy into a live state.

:func:`restore_from` picks the candidates (the requested step, or the newest), tries each copy fastest tier
first and falls back on a copy that is missing or fails verification (to another tier, then, for "newest",
to an older step). :class:`Restore` reads one copy: it decides, for each stored tensor, whether its bytes
can land directly in a live tensor's memory (same dtype and shape, CPU, contiguous, not already claimed by
another stored tensor), allocates the rest (pinned when a CUDA copy follows), reads everything with checksum
verification, then copies to the live tensors that could not be read in place and loads the tree into the
live state.
Nothing in the live state changes through ``load_state_dict`` or dict updates unless every byte verified.
In a collective restore the ranks of one machine split the checks of the replicated state (splitverify.py):
such a rank loads the live state only after the restore's agreement, where every rank reports its share, and
the ranks agree once more after that load, so that a load failing on one rank fails every rank
(restore_agree.py).

Anti-scope: the byte reads and checksums (engine/reader.py), matching a saved tree against a live state
(destinations.py) and rebuilding it (state.py), which tiers exist and what they hold (tiers.py).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import replication, splitverify
from .catalog import OpenCheckpoint
from .collective import Collective, rank_view, shared_shards, view_part
from .destinations import (
    Target,
    cpu_byte_view,
    first_free,
    fits,
    fresh_tensor,
    match_targets,
    new_tensor,
    readable_in_place,
    span,
)
from .engine.reader import ReadRequest, verify_in_memory
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    StateMismatchError,
    StorageError,
    TiersaveError,
    TiersaveWarning,
)
from .format.jsonsafe import paused_gc
from .partial import ALL, Loader, LoadReport, Selection, cast_hint, castable, referenced, select_into, select_keys
from .restore_agree import agree_on_copy, finish_together
from .state import apply_into, as_bits, decode_placeholders, fill_tree, ndarray_byte_view, torch_dtype
from .tiers import TierChain, TierRuntime

if TYPE_CHECKING:  # pragma: no cover
    from .dist import CoordinationGroup, Json
    from .format.manifest import TensorEntry


@dataclass
class RestoreReport:
    """What the last ``restore()`` did.

    Attributes:
        step: the step restored.
        location: URI of the checkpoint read.
        bytes_read: tensor bytes read and verified (by this rank, or, for ``unchecked_bytes`` of them, by
            another rank of this machine that read the same bytes of the same file).
        seconds: wall time of the restore.
        in_place: tensors read directly into the live state's memory.
        skipped: ``(step, reason)`` for each copy (newer, or in a faster tier) that could not be used.
        tier: the name of the tier it was read from.
        missing: (``strict=False``) paths of the live state the checkpoint had nothing for, a module's included.
        unexpected: (``strict=False``) saved keys a module does not have: not read.
        mismatched: (``strict=False``) saved tensors whose shape differs from the live one: not read, the live
            tensor keeps its value.
        cast: paths of tensors converted to another dtype (``cast=True`` or ``dtype=``).
        source: where this rank's bytes came from: the tier's URI, or, for a memory tier with replicas whose
            copy was lost with its node, the peer node whose replica was pulled first.
        unchecked_bytes: (collective restores, ranks sharing a machine) replicated bytes this rank read without
            checking their CRC-32C because the rank of its machine that checks them reported them verified
            (docs/guarantees.md); 0 when it checked everything it read.
    """

    step: int
    location: str
    bytes_read: int
    seconds: float
    in_place: int
    skipped: list[tuple[int, str]] = field(default_factory=list)
    tier: str = ""
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    source: str = ""
    unchecked_bytes: int = 0


def restore_from(
    chain: TierChain,
    step: int | None,
    tag: str | None,
    into: Any,
    strict: bool,
    pool: Executor,
    *,
    collective: Collective | None = None,
    rank: int | None = None,
    selection: Selection = ALL,
) -> tuple[Any, RestoreReport]:
    """Restore ``step`` (None: the newest; with ``tag``, the newest carrying it) from the fastest tier holding
    a good copy; see ``Checkpointer.restore`` for the fallback rules and the errors raised.

    With ``collective`` (a collective restore), every rank tries rank 0's list of copies in order, reads its own
    part (``rank``) of each, and the ranks move on to the next copy together when any of them could not use
    it, so that all restore the same step. ``rank`` (a single process only) reads that rank's state of a
    checkpoint saved by several ranks. ``selection``: the part to read (``keys=``) and the dtype cast. With peer
    replicas of the memory tier, a rank whose memory lost the step (a replacement node) pulls its node's part
    from a peer's replica first."""
    if collective is not None and rank is not None:
        raise ConfigError("rank= is for reading one rank's state in a single process; each rank restores its own")
    group = collective.group if collective is not None else None
    world_size = collective.world_size if collective is not None else 1
    rank = collective.rank if collective is not None else rank
    replicas = replication.of(chain)
    start = time.perf_counter()
    if group is None or group.is_coordinator:
        _warn_damaged(chain)
    skipped: list[tuple[int, str]] = []
    last_error: TiersaveError | None = None
    for _ in range(_MAX_RELISTS):
        vanished = False
        for candidate, holders in _candidates(chain, step, tag, group, replicas):
            for tier in holders:
                error: TiersaveError | None = None
                failure: Exception | None = None  # a failure of another kind (a bug, a copy onto a device)
                deferred = False  # some rank loads its live state only after the agreement
                source = tier.storage.uri
                job: Restore | None = None
                chain.protection.hold(tier.index, candidate)  # our own retention must not delete what we read
                try:

                    def read(ckpt: OpenCheckpoint) -> Restore:
                        ckpt.manifest = rank_view(ckpt.manifest, rank, world_size)
                        node: list[int] = []
                        if group is not None and group.identity.local_world_size > 1:
                            ckpt.shared = shared_shards(ckpt.manifest)
                            node = list(replication.node_ranks(group))
                        job = Restore(ckpt, into, strict, selection, node=node, rank=rank or 0)
                        job.read(pool)
                        if job.split is None:  # every byte checked here: apply it before the agreement, as always
                            job.finish()
                        return job

                    job, source = replication.read_copy(replicas, tier, candidate, read, view_part(rank, world_size))
                except (FormatError, CheckpointNotFoundError, StorageError) as exc:  # this copy is unusable
                    error = exc
                except TiersaveError as exc:  # not a matter of this copy: every rank stops here
                    if group is None:
                        raise
                    error = exc
                except Exception as exc:  # the other ranks must learn it now, not after their timeout
                    if group is None:
                        raise
                    failure = exc
                finally:
                    chain.protection.release(tier.index, candidate)
                if group is not None:
                    ok = error is None and failure is None
                    error, deferred = agree_on_copy(group, candidate, error or failure, job if ok else None)
                elif error is not None and candidate not in tier.catalog.steps():
                    # Deleted since we listed it (another process's retention): not damage. Try the next
                    # copy; if none works, list again: the writer committed a newer one.
                    if step is not None:
                        raise CheckpointNotFoundError(
                            f"step {step} was deleted from {tier.storage.uri} while it was being read"
                        ) from error
                    vanished = True
                    continue
                if error is not None:
                    last_error = error
                    skipped.append((candidate, f"on {tier.name}: {error}"))
                    fallback = "another tier" if tier is not holders[-1] else "an older checkpoint"
                    if step is not None and tier is holders[-1]:
                        break
                    warnings.warn(
                        f"skipping the copy of step {candidate} on tier {tier.name} ({tier.storage.uri}): "
                        f"{error}; trying {fallback}",
                        TiersaveWarning,
                        stacklevel=3,
                    )
                    continue
                assert job is not None
                # Split checks: the live state changes only now that every rank of the machine reported its share
                # of the replicated bytes verified (or checked the rest itself).
                # ... and in a collective restore every rank learns whether every rank's load succeeded.
                if deferred:
                    assert group is not None
                    result, nbytes, in_place = finish_together(group, candidate, job)
                else:
                    result, nbytes, in_place = job.finish()
                location = tier.catalog.location(candidate)
                report = RestoreReport(
                    candidate, location, nbytes, time.perf_counter() - start, in_place, skipped, tier.name
                )
                report.unchecked_bytes = job.split.unchecked_bytes if job.split is not None else 0
                for what in ("missing", "unexpected", "mismatched", "cast"):  # what a partial restore left out
                    setattr(report, what, getattr(job.loaded, what))
                job.loaded.log(candidate)
                report.source = source
                return result, report
        if not vanished:
            break
    if step is not None and last_error is not None and len(skipped) == 1:
        raise last_error
    if last_error is None:
        raise CheckpointNotFoundError(
            f"every checkpoint in {chain.where()} was deleted while being read, {_MAX_RELISTS} times in a row"
        )
    raise CorruptCheckpointError(
        "no usable checkpoint: every candidate failed: " + "; ".join(f"step {s} {why}" for s, why in skipped)
    ) from last_error


def _warn_damaged(chain: TierChain) -> None:
    """Warn once per restore about step directories that are no checkpoint (no manifest) and were skipped:
    a person should look at them (a damaged disk, a copy made by hand), and nothing removes them."""
    damaged = [f"{t.storage.uri.rstrip('/')}/{name}" for t in chain.tiers for name in t.catalog.damaged()]
    if damaged:
        warnings.warn(
            f"restore skipped {len(damaged)} damaged step director{'y' if len(damaged) == 1 else 'ies'} without a "
            f"manifest (not checkpoints; nothing removes them): {', '.join(damaged)}",
            TiersaveWarning,
            stacklevel=4,
        )


_MAX_RELISTS = 8
"""How many times a restore lists the checkpoints again when the ones it listed were deleted while it read
them (a writer in another process saving fast with a small ``keep_last``)."""


def _candidates(
    chain: TierChain,
    step: int | None,
    tag: str | None,
    group: CoordinationGroup | None,
    replicas: replication.Replicas | None = None,
) -> list[tuple[int, list[TierRuntime]]]:
    """The copies to try, newest step first, fastest tier first; in a collective restore, rank 0's list (with
    peer replicas: the memory tier for the steps every node has in memory or in a peer's replica)."""
    holders: dict[int, list[TierRuntime]] = {}
    missing: list[CheckpointNotFoundError] = []
    # With peer replicas, every node tells rank 0 what it can restore from memory (collective; rank 0's own
    # memory may be the one lost, with its movable tags).
    agreed = replicas.restorable(step, tag) if replicas is not None else None
    # A movable tag (tags.py, on the first tier) wins over every tier's manifest tags: it names one step.
    moved = chain.first.catalog.tags.resolve(tag) if tag is not None else None
    moved_step = agreed[0] if agreed is not None and agreed[0] is not None else moved.step if moved else None
    if moved_step is not None and (step is None or step == moved_step):
        step, tag = moved_step, None
    for tier in chain.tiers:
        try:
            found = tier.catalog.find(step, tag)
        except CheckpointNotFoundError as exc:
            missing.append(exc)
            continue
        for s in found:
            holders.setdefault(s, []).append(tier)
    if replicas is not None and agreed is not None:  # rank 0's memory may be the one lost: add, never drop
        for s in agreed[1]:
            holders[s] = [replicas.tier, *(t for t in holders.get(s, []) if t is not replicas.tier)]
    if group is not None:
        mine: Json = [[s, [t.name for t in holders[s]]] for s in sorted(holders, reverse=True)]
        plan: Any = group.broadcast_json(mine if group.is_coordinator else None)
        if not isinstance(plan, list):
            raise ConfigError(f"rank 0 sent no restore plan (got {plan!r})")
        holders = {int(s): [chain.get(str(name)) for name in names] for s, names in plan}
    if not holders:
        if len(missing) == 1:
            raise missing[0]
        if missing:
            raise CheckpointNotFoundError("; ".join(str(e) for e in missing))
        raise CheckpointNotFoundError(f"no committed checkpoint in {chain.where()}")
    return [(s, holders[s]) for s in sorted(holders, reverse=True)]


class Restore:
    """One restore of one checkpoint: choose destinations, read, copy, rebuild."""

    def __init__(
        self,
        ckpt: OpenCheckpoint,
        into: Any,
        strict: bool,
        selection: Selection = ALL,
        *,
        node: Sequence[int] = (),
        rank: int = 0,
    ) -> None:
        self.ckpt = ckpt
        self.into = into
        self.strict = strict
        self.selection = selection
        self.loaded = LoadReport()
        self.node = node  # the ranks of this machine (a collective restore): they split the replicated checks
        self.rank = rank
        self.split: splitverify.Split | None = None
        self._done: tuple[Any, int, int] | None = None  # finish()'s result
        self._pool: Executor | None = None
        self._read: tuple[Any, dict[str, torch.Tensor | np.ndarray], dict[str, list[Target]], list[ReadRequest]] | None
        self._read = None
        self._in_place = 0

    def run(self, pool: Executor) -> tuple[Any, int, int]:
        """Read and verify everything, then load it into the live state: ``(result, bytes read, in place)``."""
        self.read(pool)
        return self.finish()

    def read(self, pool: Executor) -> None:
        """Choose the destinations and read every byte into them; the live state's tree is not touched yet."""
        self._pool = pool
        with paused_gc():  # 10^5 tensors make 10^6 small objects; see paused_gc
            self._read_all(pool)

    def finish(self) -> tuple[Any, int, int]:
        """Copy what was not read in place into the live tensors and load the tree into the live state, once: a
        later call (a restore that finished before the ranks' agreement) returns the first call's result."""
        if self._done is not None:
            return self._done
        with paused_gc():
            self._done = self._finish()
        self._read = None  # the destinations are the result's now: no reference to them from this job
        return self._done

    def verify_unchecked(self) -> None:
        """Check the bytes read unchecked (left to another rank of the machine) in memory, here.

        Raises:
            CorruptCheckpointError: a chunk does not match its checksum (the message names the file and chunk).
        """
        if self.split is None or not self.split.unchecked:
            return
        assert self._pool is not None, "verify_unchecked() before read()"
        verify_in_memory(
            self.split.unchecked,
            chunk_bytes=self.ckpt.manifest.chunk_bytes,
            executor=self._pool,
            describe=self.ckpt.describe,
        )
        self.split.unchecked.clear()

    def _read_all(self, pool: Executor) -> None:
        manifest = self.ckpt.manifest
        saved = decode_placeholders(manifest.tree)
        sel, casting = self.selection, self.selection.casting
        # A partial restore reads only the tensors of the part asked for (keys=) and held by the live state.
        if sel.keys is not None:
            saved = select_keys(saved, sel.keys, manifest.step)
        if self.into is not None:
            shapes = {name: entry.shape for name, entry in manifest.tensors.items()}
            saved = select_into(saved, self.into, strict=self.strict, shapes=shapes, report=self.loaded)
        wanted = referenced(saved) if sel.keys is not None or self.into is not None else None
        targets = match_targets(saved, self.into, strict=self.strict) if self.into is not None else {}
        requests: list[ReadRequest] = []
        dests: dict[str, torch.Tensor | np.ndarray] = {}
        # The stored tensors that have live tensors to land in, and for each the live ones it could be read into
        # in place (same dtype and shape, CPU, contiguous): which one it takes is decided for all of them at once.
        placed: list[tuple[str, TensorEntry, list[Target]]] = []
        usable: list[list[torch.Tensor | np.ndarray]] = []
        no_targets: list[Target] = []
        for name, entry in manifest.tensors.items():
            if wanted is not None and name not in wanted:
                continue
            candidates = targets.get(name, no_targets)
            if not candidates:  # the common case of a new tree: a fresh tensor, read into as it is
                dest_t, view = fresh_tensor(entry.shape, torch_dtype(entry.dtype), entry.nbytes)
                dests[name] = dest_t
                requests.append(ReadRequest(entry, view))
                continue
            ready: list[torch.Tensor | np.ndarray] = []
            for t in candidates:
                if fits(t.value, entry.dtype, entry.shape):
                    if readable_in_place(t.value):
                        ready.append(t.value)
                elif casting and castable(t.value, entry.dtype, entry.shape):
                    self.loaded.cast.append(t.path)
                elif t.strict or tuple(t.value.shape) == entry.shape:  # a module's shapes: load_state_dict decides
                    raise StateMismatchError(
                        f"{t.path}: the live value is {_describe(t.value)} but step {manifest.step} holds "
                        f"{entry.dtype}{list(entry.shape)}{cast_hint(t.value, entry.dtype, entry.shape)}"
                    )
            placed.append((name, entry, candidates))
            usable.append(ready)
        # A live tensor whose memory another stored tensor already fills (tied in the live model) is copied into.
        picks = first_free([[span(v) for v in values] for values in usable])
        for (name, entry, candidates), values, pick in zip(placed, usable, picks):
            if pick < 0:
                pin = any(isinstance(t.value, torch.Tensor) and t.value.device.type == "cuda" for t in candidates)
                dest: torch.Tensor | np.ndarray = new_tensor(
                    entry.shape, torch_dtype(entry.dtype), entry.nbytes, pin=pin
                )
            else:
                dest = values[pick]
            dests[name] = dest
            view = ndarray_byte_view(dest) if isinstance(dest, np.ndarray) else cpu_byte_view(dest)
            requests.append(ReadRequest(entry, view))
        in_place = len(picks) - picks.count(-1)
        if self.node:
            self.split = splitverify.plan(self.ckpt, requests, self.rank, self.node)
        self.ckpt.read(requests, executor=pool)
        if self.split is not None:
            self.split.close()
        self._read = (saved, dests, targets, requests)
        self._in_place = in_place

    def _finish(self) -> tuple[Any, int, int]:
        assert self._read is not None, "finish() before read()"
        saved, dests, targets, requests = self._read
        manifest, sel, casting = self.ckpt.manifest, self.selection, self.selection.casting
        no_targets: list[Target] = []
        in_place = self._in_place
        values: dict[str, Any] = dests if not targets else {}
        cuda = False
        for name, dest in dests.items() if targets else ():
            entry = manifest.tensors[name]
            primary: Any = dest
            for t in targets.get(name, no_targets):
                if t.value is dest:
                    continue
                if fits(t.value, entry.dtype, entry.shape):
                    _copy_into(t.value, dest)
                elif casting and castable(t.value, entry.dtype, entry.shape):
                    _cast_into(t.value, dest)
                else:
                    continue
                cuda = cuda or (isinstance(t.value, torch.Tensor) and t.value.device.type == "cuda")
                if primary is dest:
                    primary = t.value
            values[name] = primary
        if cuda:
            torch.cuda.synchronize()
        if sel.dtype is not None:
            self._to_dtype(values, targets, sel.dtype)
        if self.into is None:
            result = fill_tree(saved, values)
        else:
            result = apply_into(saved, self.into, values, load=Loader(self.strict, self.loaded))
        return result, sum(r.entry.nbytes for r in requests), in_place

    def _to_dtype(self, values: dict[str, Any], targets: dict[str, list[Target]], dtype: torch.dtype) -> None:
        """``dtype=``: the floating-point tensors that land in no live tensor become ``dtype``."""
        for name, value in values.items():
            if name in targets or not isinstance(value, torch.Tensor):
                continue
            if value.dtype.is_floating_point and value.dtype != dtype:
                values[name] = value.to(dtype)
                self.loaded.cast.append(name)


def _copy_into(target: torch.Tensor | np.ndarray, src: torch.Tensor | np.ndarray) -> None:
    if isinstance(target, np.ndarray):
        np.copyto(target, src.numpy() if isinstance(src, torch.Tensor) else src)
        return
    source = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    with torch.no_grad():
        as_bits(target).copy_(as_bits(source), non_blocking=target.device.type == "cuda")


def _cast_into(target: torch.Tensor | np.ndarray, src: torch.Tensor | np.ndarray) -> None:
    """The opt-in dtype cast: a converting copy (the plain path copies bits); ``castable`` chose a tensor."""
    assert isinstance(target, torch.Tensor)
    source = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    with torch.no_grad():
        target.copy_(source, non_blocking=target.device.type == "cuda")


def _describe(value: torch.Tensor | np.ndarray) -> str:
    if isinstance(value, np.ndarray):
        return f"numpy {value.dtype}{list(value.shape)}"
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)} on {value.device}"
