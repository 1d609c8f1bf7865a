"""Reference-aware retention and the base of incremental saves (docs/format.md section 9).

A checkpoint written by an incremental save may reference shards held by earlier step directories. Retention
must then never delete a step that a kept checkpoint references, nor what a step kept for that reason references
in turn (:func:`deletable`; a reader follows one reference, never a chain), nor the base an unfinished
incremental save is about to reference (:class:`Pins`). Deleting stays the atomic un-commit of docs/format.md
section 6, one step at a time and newest first, so a kill at any instant of retention leaves every kept
checkpoint whole.

With many ranks, each rank references its own shards of the previous committed checkpoint (:func:`rank_base`):
the same rank of a job of the same size; a checkpoint saved by another number of ranks is no base.

Retention of a Checkpointer's tiers also spares the steps its drains and restores are reading
(:class:`Protection`, in-process, per tier).

Scope: which steps retention may delete given the references, pins of unfinished saves, the steps being read
(:class:`Protection`), the full/incremental choice of one save and the part of a base one rank may reference.
Anti-scope: listing and deleting
(catalog.py), the per-piece hashing and skipping (engine/increment.py), the format (format/manifest.py).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from .errors import CheckpointNotFoundError, ConfigError, FormatError, SaveError
from .format.layout import MANIFEST_NAME, step_dirname
from .format.manifest import Manifest, TensorEntry
from .storage.base import Storage

CHAIN_STAT = "incremental_chain"
"""The manifest ``stats`` key counting the incremental saves since the last full one (0 for a full one)."""


@dataclass(frozen=True)
class Incremental:
    """The options of incremental saves: a full save every ``full_every`` saves (None: only without base)."""

    full_every: int | None = None


def check_incremental(incremental: object, full_every: object) -> Incremental | None:
    """Validate ``Checkpointer(incremental=..., full_every=...)``; None when saves are not incremental.

    Raises:
        ConfigError: ``incremental`` is not a bool, or ``full_every`` not a positive integer or None, or the
            content hash asked for (``TIERSAVE_CONTENT_HASH``) is not available.
    """
    if not isinstance(incremental, bool):
        raise ConfigError(f"incremental must be True or False, got {incremental!r}")
    if full_every is not None and (isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1):
        raise ConfigError(f"full_every must be a positive integer or None, got {full_every!r}")
    if full_every is not None and not incremental:
        raise ConfigError("full_every applies to incremental saves: pass incremental=True with it")
    if incremental:
        from .engine.increment import content_hash  # here: catalog.py imports this module, and must not need torch

        content_hash()  # TIERSAVE_CONTENT_HASH=blake3 without the package fails here rather than at the first save
    return Incremental(full_every) if incremental else None


def chain_of(base: Manifest | None) -> int:
    """How many incremental saves a save referencing ``base`` would follow since the last full one."""
    if base is None:
        return 0
    raw = base.stats.get(CHAIN_STAT, 0)
    previous = raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else 0
    return previous + 1


MAX_KEPT_BY_REFERENCES = 8
"""When retention keeps more steps than this only because later checkpoints reference them (a chain: tensors that
change in turn, each save referencing the one before), the next incremental save or drain is a full one: the
chain ends there and disk use stays bounded even with ``full_every=None``. A frozen base referenced by every save
keeps one step, so it never triggers this."""


def wants_full(base: Manifest | None, full_every: int | None, kept_by_references: int = 0) -> bool:
    """True when the next save must be full: no base, ``full_every`` saves since the last full one, or a chain of
    references that made retention keep more than :data:`MAX_KEPT_BY_REFERENCES` steps."""
    if base is None or kept_by_references > MAX_KEPT_BY_REFERENCES:
        return True
    return full_every is not None and chain_of(base) >= full_every


def rank_base(base: Manifest | None, rank: int, world_size: int) -> Manifest | None:
    """What rank ``rank`` of a job of ``world_size`` ranks may reference in ``base``: the base itself for a
    single process; for many ranks, the rank's own shards, with the tensors in them under the names the rank's
    save gives them (its own without ``rank-RRRRR/``, the replicated ones it wrote without ``replicated/``).
    None (a full save) when ``base`` was saved by another number of ranks: its shards hold other slices."""
    if base is None or base.world_size != world_size:
        return None
    if world_size == 1:
        return base
    from .collective import rank_key  # here: replicated.py imports torch, which catalog.py must not need
    from .replicated import REPLICATED_PREFIX

    local: dict[int, int] = {}
    for index, shard in enumerate(base.shards):
        if shard.rank == rank:
            local[index] = len(local)
    own = rank_key(rank) + "/"
    tensors: dict[str, TensorEntry] = {}
    for name, t in base.tensors.items():
        if t.shard in local:
            for prefix in (own, REPLICATED_PREFIX):
                if name.startswith(prefix):
                    short = name[len(prefix) :]
                    tensors[short] = replace(t, name=short, shard=local[t.shard])
    shards = tuple(base.shards[i] for i in local)
    return replace(base, shards=shards, tensors=tensors, tree={})


def deletable(doomed: Iterable[int], manifests: Iterable[Manifest]) -> tuple[list[int], dict[int, frozenset[int]]]:
    """The steps of ``doomed`` that no kept checkpoint needs, newest first, and what each doomed step references.

    A doomed step that a kept one references stays, and so does what it references in turn: a shard unchanged
    for one save and then changed gives step 3 a reference into step 2 and step 2 one into step 1, and keeping
    step 2 for step 3 while deleting step 1 would leave step 2 listed and broken. References point to earlier
    steps, so one pass from the newest settles it. Deleting in that order (newest first) means a round that stops
    early (a kill, a step tagged or leased since the plan) never leaves a kept step without its base, as long as
    the caller also keeps what a step it did not delete references (the map returned)."""
    refs = {m.step: m.referenced_steps for m in manifests}
    doomed_set = set(doomed)
    held: set[int] = set().union(*(r for step, r in refs.items() if step not in doomed_set))
    out = []
    for step in sorted(doomed_set, reverse=True):
        if step in held:
            held |= refs.get(step, frozenset())  # a step deleted meanwhile by someone else references nothing
        else:
            out.append(step)
    return out, {step: refs.get(step, frozenset()) for step in doomed_set}


def unneeded(
    doomed: list[int], pinned: Collection[int], steps: Iterable[int], manifest_of: Callable[[int], Manifest]
) -> tuple[list[int], dict[int, frozenset[int]]]:
    """``doomed`` less the pinned steps and the steps a kept checkpoint needs (:func:`deletable`), newest first,
    and what each doomed step references; ``steps`` are the root's committed steps, read with ``manifest_of``.
    In a root of incremental saves, a kept manifest that cannot be read keeps every doomed step: its references
    are unknown."""
    doomed = [s for s in doomed if s not in pinned]
    if not doomed:  # nothing to check: no manifest read
        return [], {}
    manifests, unreadable = [], False
    for step in steps:
        try:
            manifests.append(manifest_of(step))
        except CheckpointNotFoundError:
            continue  # deleted meanwhile by someone else: it references nothing any more
        except FormatError:
            unreadable = unreadable or step not in doomed
    if unreadable and any(s.content for m in manifests for s in m.shards):
        return [], {}
    return deletable(doomed, manifests)


def check_holders(storage: Storage, manifest: Manifest) -> None:
    """Before an incremental save commits: every step it references is still committed.

    The pin protects the base from this process's retention only; this catches another process's prune (or a
    person) having deleted it meanwhile, so that such a save fails instead of committing dangling references.

    Raises:
        SaveError: a referenced step is gone.
    """
    for step in sorted(manifest.referenced_steps):
        if not storage.exists(f"{step_dirname(step)}/{MANIFEST_NAME}"):
            raise SaveError(
                f"step {manifest.step}: step {step}, whose shards this incremental save references, was deleted "
                f"from {storage.uri} while the save was running; nothing was committed"
            )


class Pins:
    """Steps that unfinished incremental saves of this process will reference, and the step being deleted.

    Retention skips a pinned step; a pin taken while retention deletes that very step gets no base (the
    save is then a full one); and retention stops its round at the first pin taken after it planned, since
    the steps that the newly pinned base references may be among those it planned to delete.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pins: Counter[int] = Counter()
        self._deleting: int | None = None
        self._generation = 0

    def pin(self, step: int, read: Callable[[int], Manifest | None]) -> Manifest | None:
        """Pin ``step`` and return ``read(step)``; None (and no pin) if it is being deleted or unreadable."""
        with self._lock:
            if self._deleting == step:
                return None
            self._pins[step] += 1
            self._generation += 1
        manifest = read(step)
        if manifest is None:
            self.unpin(step)
        return manifest

    def unpin(self, step: int) -> None:
        with self._lock:
            self._pins[step] -= 1
            if self._pins[step] <= 0:
                del self._pins[step]

    def pinned(self) -> tuple[frozenset[int], int]:
        """The pinned steps and the generation to pass to :meth:`deleting`."""
        with self._lock:
            return frozenset(self._pins), self._generation

    @contextmanager
    def deleting(self, step: int, generation: int) -> Iterator[bool]:
        """Mark ``step`` as being deleted; yields False (delete nothing more) if a pin was taken since
        ``generation``."""
        with self._lock:
            allowed = self._generation == generation
            if allowed:
                self._deleting = step
        if not allowed:
            yield False
            return
        try:
            yield True
        finally:
            with self._lock:
                self._deleting = None


class Protection:
    """Steps that retention must not delete, per tier: being drained from, or being restored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, Counter[int]] = {}

    def hold(self, tier: int, step: int) -> None:
        with self._lock:
            self._held.setdefault(tier, Counter())[step] += 1

    def release(self, tier: int, step: int) -> None:
        with self._lock:
            counter = self._held.get(tier)
            if counter is not None:
                counter[step] -= 1
                if counter[step] <= 0:
                    del counter[step]

    def steps(self, tier: int) -> frozenset[int]:
        with self._lock:
            return frozenset(self._held.get(tier, ()))
