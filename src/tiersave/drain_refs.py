"""Incremental drains: ``Tier(..., incremental=True)`` references unchanged shards instead of copying them.

A drain of step S to an incremental later tier compares S's manifest with the manifest of the newest step
committed on that tier before S (its *base*, pinned in the tier's catalog against its retention until the
drain ends). A shard of S whose rank, size, tensors (names, dtypes, shapes, offsets) and content hashes
(function, piece lengths and digests) equal a shard of the base is not copied: the destination manifest
references the base's file on the tier, in the step directory that holds it (docs/format.md section 9). The
comparison is over the *decoded* bytes' hashes, so a compressed tier references compressed shards (the
reference carries the held shard's encoding). Before the commit, every referenced file is checked to be on
the destination with the size its manifest gives it; the tier's retention then keeps the referenced steps
(``Catalog.prune`` marks from the kept manifests), and ``full_every`` makes every K-th drain of the tier a
full one, counted in the destination manifest's ``incremental_chain`` stat.

Content hashes come from the source: an incremental first tier (``Checkpointer(..., incremental=True)``)
computes them on its writer threads. A source shard without them is copied whole, and a drain whose source has
none at all is a full one, with the reason logged once per tier (warning ``tiersave.drain_refs``); the shards'
hashes are kept on the incremental tier so that the next drain can compare with them.

Scope: choosing and pinning a drain's base, deciding which shards to reference, the destination manifest's
reference entries and their check before the commit, the call of one drain to a tier. Anti-scope: moving and
verifying bytes (drain.py), the hashes themselves (engine/increment.py), retention (catalog.py, references.py),
cadence and the drain threads (tiers.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from concurrent.futures import Executor
from typing import Protocol

from .autocompress import AutoCompress
from .catalog import Catalog
from .drain import CopyResult, copy_checkpoint, cut
from .engine.codec import require_codec
from .errors import CorruptCheckpointError, ObjectNotFoundError
from .format.layout import MANIFEST_NAME, step_dirname
from .format.manifest import Manifest, ShardInfo, TensorEntry
from .references import CHAIN_STAT, chain_of, check_incremental, wants_full
from .storage.base import Storage

log = logging.getLogger(__name__)

__all__ = ["ShardRefs", "check_drain_options", "drain_to"]

_Layout = tuple[int, int, tuple[tuple[int, str, str, tuple[int, ...]], ...], tuple[tuple[int, str], ...]]


def check_drain_options(compress: str | None, incremental: object, full_every: object) -> None:
    """Validate a tier's ``compress``, ``incremental`` and ``full_every``.

    Raises:
        ConfigError: an unknown codec or a missing ``zstandard``; ``incremental`` not a bool; ``full_every`` not
            a positive integer, or given without ``incremental=True``.
    """
    if compress is not None:
        require_codec("zstd" if compress == "auto" else compress)
    check_incremental(incremental, full_every)


def _layouts(manifest: Manifest) -> list[_Layout]:
    """What each shard holds, as compared between a drained step and its base: rank, size, tensors and the
    content hashes (empty when the shard has none)."""
    members: dict[int, list[tuple[int, str, str, tuple[int, ...]]]] = {}
    for t in manifest.tensors.values():
        members.setdefault(t.shard, []).append((t.offset, t.name, t.dtype, t.shape))
    return [(s.rank, s.size, tuple(sorted(members.get(i, ()))), s.content) for i, s in enumerate(manifest.shards)]


class ShardRefs:
    """One incremental drain of ``manifest``'s step to ``dst`` against ``base`` (None: a full drain that keeps
    the content hashes). :func:`~tiersave.drain.copy_checkpoint` copies :attr:`work` (the shards to copy) and
    hands its destination manifest to :meth:`complete`, which puts the references back in place.

    Args:
        dst: the destination storage (the tier).
        manifest: the source manifest of the step drained.
        base: the destination's manifest of the step to reference (pinned by the caller), or None.
    """

    def __init__(self, dst: Storage, manifest: Manifest, base: Manifest | None) -> None:
        self.dst = dst
        self.source = manifest
        self.base = base
        self.refs: dict[int, ShardInfo] = {}
        if base is not None and base.content_hash != manifest.content_hash:
            log.info("step %d: the tier's step %d is hashed otherwise: a full drain", manifest.step, base.step)
        elif base is not None:
            # a shard without hashes or without tensors is never matched: two such shards could not both
            # reference one held shard (no two shards of a manifest name the same file)
            held = {layout: i for i, layout in enumerate(_layouts(base)) if layout[2] and layout[3]}
            for i, layout in enumerate(_layouts(manifest)):
                match = held.get(layout) if layout[2] and layout[3] else None
                if match is not None:
                    shard = base.shards[match]
                    holder = shard.step if shard.step is not None else base.step  # references never chain
                    self.refs[i] = dataclasses.replace(shard, step=holder)
        self.copied = [i for i in range(len(manifest.shards)) if i not in self.refs]
        self.work = cut(manifest, self.copied)

    @property
    def referenced_bytes(self) -> int:
        """Decoded bytes of the shards referenced instead of copied."""
        return sum(s.size for s in self.refs.values())

    def complete(self, written: Manifest) -> Manifest:
        """The destination manifest: ``written`` (the copied shards, as stored on ``dst``) with their content
        hashes, and the referenced shards back in their places; every referenced file is checked on ``dst``.

        Raises:
            CorruptCheckpointError: a referenced file is missing on ``dst`` or has another size than its
                manifest gives it (deleted or damaged since the base was committed).
        """
        shards: list[ShardInfo] = []
        copied = iter(written.shards)
        for i, shard in enumerate(self.source.shards):
            shards.append(self.refs[i] if i in self.refs else dataclasses.replace(next(copied), content=shard.content))
        stats = {**self.source.stats, CHAIN_STAT: chain_of(self.base) if self.refs else 0}
        tensors: dict[str, TensorEntry] = dict(self.source.tensors)
        return dataclasses.replace(written, shards=tuple(shards), tensors=tensors, stats=stats)

    def check_present(self) -> None:
        """Every referenced shard is on the tier, at its size, in a step still committed there (a retention
        un-commits a step before deleting its files); else nothing may be committed."""
        committed: dict[int, bool] = {}
        for ref in self.refs.values():
            key = ref.key(step_dirname(self.source.step))
            holder = ref.step or 0
            if holder not in committed:
                committed[holder] = self.dst.exists(f"{step_dirname(holder)}/{MANIFEST_NAME}")
            try:
                size: int | None = self.dst.head(key).size if committed[holder] else None
            except ObjectNotFoundError:
                size = None
            if size != ref.stored_size:
                what = "not committed there" if size is None else f"{size} bytes there, not {ref.stored_size}"
                raise CorruptCheckpointError(
                    f"step {self.source.step}: the drain to {self.dst.uri} references {key} (held by step "
                    f"{ref.step}), which is {what}; nothing was committed",
                    step=self.source.step,
                    file=ref.file,
                )


class TierOptions(Protocol):
    """What a drain reads of a ``Tier``."""

    @property
    def compress(self) -> str | None: ...
    @property
    def incremental(self) -> bool: ...
    @property
    def full_every(self) -> int | None: ...


class DrainTier(Protocol):
    """What a drain reads of a ``TierRuntime`` (and ``warned_unhashed``, which it sets: whether this tier's
    drains already warned that the source has no content hashes, so that it says so once per tier)."""

    warned_unhashed: bool

    @property
    def name(self) -> str: ...
    @property
    def storage(self) -> Storage: ...
    @property
    def catalog(self) -> Catalog: ...
    @property
    def copier(self) -> Executor | None: ...
    @property
    def auto(self) -> AutoCompress | None: ...
    @property
    def spec(self) -> TierOptions: ...


def drain_to(tier: DrainTier, source: Catalog, step: int) -> CopyResult:
    """Copy committed ``step`` from ``source`` (the first tier's catalog, whose manifests are cached: the drain
    parses none) to ``tier`` with its compression and, on an incremental tier, referencing the shards equal to the
    tier's newest step before ``step`` (pinned until the drain ends). Runs on the tier's drain thread."""
    run = functools.partial(copy_checkpoint, source, tier.storage, step, if_exists="skip", executor=tier.copier)
    base: Manifest | None = None
    try:
        if tier.spec.incremental:
            older = [s for s in tier.catalog.steps() if s < step]
            base = tier.catalog.pin(older[-1]) if older else None
            manifest = source.manifest(step)
            if not any(s.content for s in manifest.shards) and not tier.warned_unhashed:
                tier.warned_unhashed = True  # once per tier of a Checkpointer: the same is true of every drain
                log.warning(
                    "tier %s (%s): step %d has no content hashes, so drains to this incremental tier are full "
                    "copies; give the Checkpointer incremental=True so that its saves hash their shards",
                    tier.name,
                    tier.storage.uri,
                    step,
                )
            chosen = None if wants_full(base, tier.spec.full_every, tier.catalog.kept_by_references) else base
            run = functools.partial(run, refs=ShardRefs(tier.storage, manifest, chosen))
        return run(compress=tier.spec.compress) if tier.auto is None else tier.auto.drain(run)
    finally:
        if base is not None:
            tier.catalog.unpin(base.step)
