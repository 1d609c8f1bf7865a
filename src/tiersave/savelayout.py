"""The layout of a save, reused from the previous save when the state has the same structure.

What a save does on the caller's thread before copying a byte depends only on the state's structure: the
flattened tensor table (state.py), the replicated selection and which rank writes each replicated tensor
(replicated.py), the shards, offsets and write units (engine/pipeline.py). A training loop saves the same
structure every time, so :class:`LayoutCache` keeps the last one and, when :func:`reflatten.reflatten` finds
that the new state has it (every tensor at the same path over the same memory, with the same shape, dtype and
strides), reuses all of it: the caller's thread then pays one checking walk over the state and the copy.
Anything else (a key added or removed, a tensor reshaped, cast, moved or replaced by one over other memory,
other replicated keys, another chunk size) lays the save out afresh. Plain values (step counters, RNG state)
are encoded afresh at every save either way.

Scope: deciding what of the previous save's layout a save may reuse, and keeping it. Anti-scope: flattening
and checking (state.py, reflatten.py), selecting and assigning (replicated.py), planning (engine/pipeline.py).

The cache holds no tensor (addresses, names and shapes only), so it never keeps a dropped model's memory alive.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

import torch

from .engine.pipeline import SavePlan, plan_save
from .format.layout import align_up, shard_filename
from .knobs import reuse_layout
from .reflatten import Layout, flatten_layout, reflatten
from .replicated import Selection, assign, check_keys, fingerprints, select
from .state import FlatState, FlatTensor, flatten

_NO_SOURCE = torch.empty(0)
"""The source of the replicated tensors a cached selection names: the cache keeps no tensor alive."""


@dataclass
class SaveLayout:
    """One save's layout.

    Attributes:
        flat: the flattened state (its tensors are this save's).
        selection: the replicated part (a collective save declaring ``replicated``), else None.
        own: the indices of the flattened tensors this rank writes, in the plan's order (None: all of them).
        plan: where they go.
        reused: True when the previous save's layout was reused (checked against this state).
    """

    flat: FlatState
    selection: Selection | None
    own: list[int] | None
    plan: SavePlan
    reused: bool

    @property
    def tensors(self) -> list[FlatTensor]:
        """The tensors this rank writes (a ``FlatTensor`` each, made on first use)."""
        every = self.flat.tensors
        return every if self.own is None else [every[i] for i in self.own]

    @property
    def sources(self) -> list[Any]:
        """Their values, without a ``FlatTensor`` per tensor."""
        every = self.flat.sources
        return every if self.own is None else list(map(every.__getitem__, self.own))

    @property
    def addresses(self) -> list[int | None]:
        """Their host addresses (``FlatTensor.address``)."""
        every = self.flat.addresses
        return every if self.own is None else list(map(every.__getitem__, self.own))


@dataclass
class _Kept:
    layout: Layout
    keys: tuple[str, ...] = ()
    selection: Selection | None = None  # with _NO_SOURCE tensors
    own: list[int] | None = None  # the indices of the tensors this rank writes; None: all
    padded: int = 0  # the padded bytes of those tensors
    plan: SavePlan | None = None
    plan_for: tuple[int, int | None] | None = None  # (chunk_bytes, max_shard_bytes) the plan was made with


class LayoutCache:
    """The last save's layout, for the next save of a state of the same structure.

    Args:
        rank: this process's rank (0 alone).
        world_size: the ranks saving each checkpoint (1 alone); replicated tensors are assigned among them.
        enabled: False lays every save out afresh (so does ``TIERSAVE_REUSE_LAYOUT=0``).

    Thread safety: one caller thread at a time (the Saver's staging thread).
    """

    def __init__(self, rank: int, world_size: int, *, enabled: bool = True) -> None:
        self.rank = rank
        self.world_size = world_size
        self.enabled = enabled
        self._kept: _Kept | None = None
        self.reuses = 0  # saves that reused the previous layout (statistics and tests)

    def clear(self) -> None:
        self._kept = None

    def layout(
        self,
        state: Any,
        replicated: tuple[str, ...],
        *,
        collective: bool,
        chunk_for: Callable[[int], int],
        max_shard_bytes: int | None,
    ) -> SaveLayout:
        """Flatten, select, assign and plan ``state``, reusing what the previous save found where the state
        still has its structure.

        Args:
            state: the state to save.
            replicated: the keys declared replicated (normalized; ``()``: none).
            collective: a save of several ranks (replicated tensors are then assigned to ranks).
            chunk_for: the chunk size for a save of so many padded bytes (Saver.chunk_for).
            max_shard_bytes: the shard cap the plan uses.

        Raises:
            UnsupportedStateError: the state holds something that cannot be saved.
            ConfigError: ``replicated`` does not fit the state (replicated.select).
        """
        enabled = self.enabled and reuse_layout()  # off: lay out afresh, and leave the cache as it is
        kept = self._kept if enabled else None
        flat = reflatten(state, kept.layout) if kept is not None else None
        reused = flat is not None
        if flat is None and not enabled:
            flat = flatten(state)
        elif flat is None:
            flat, layout = flatten_layout(state)
            kept = self._kept = _Kept(layout) if layout is not None else None
        if kept is not None and (not reused or kept.keys != replicated or kept.plan_for is None):
            kept.plan = kept.plan_for = None
        selection: Selection | None
        if reused and kept is not None and kept.keys == replicated and kept.plan_for is not None:
            if replicated:
                check_keys(state, flat, replicated)
            selection, own, padded = kept.selection, kept.own, kept.padded
        else:
            selection, tensors = self._select(state, flat, replicated, collective)
            own = None if tensors is flat.tensors else _indices(flat.tensors, tensors)
            padded = sum(align_up(t.nbytes) for t in tensors)
        chunk = chunk_for(padded)
        if kept is not None and kept.plan is not None and kept.plan_for == (chunk, max_shard_bytes):
            self.reuses += 1
            return SaveLayout(flat, selection, own, kept.plan, True)
        plan = plan_save(
            flat.tensors if own is None else [flat.tensors[i] for i in own],
            chunk_bytes=chunk,
            shard_file=lambda i: shard_filename(self.rank, i),
            max_shard_bytes=max_shard_bytes,
        )
        if kept is not None:
            kept.keys, kept.padded, kept.plan, kept.plan_for = replicated, padded, plan, (chunk, max_shard_bytes)
            kept.selection = _stripped(selection)
            kept.own = own
            self._kept = kept
        return SaveLayout(flat, selection, own, plan, False)

    def _select(
        self, state: Any, flat: FlatState, keys: tuple[str, ...], collective: bool
    ) -> tuple[Selection | None, list[FlatTensor]]:
        """The replicated part of a collective save, and the tensors this rank writes: its own and the
        replicated ones assigned to it."""
        if not keys:
            return None, flat.tensors
        selection = select(state, flat, keys)  # also in a single process: a bad declaration fails alike
        if not collective:
            return None, flat.tensors
        owner = assign(selection.tensors, self.world_size)
        rank = self.rank
        return selection, [t for t in flat.tensors if owner.get(t.name, rank) == rank]


def _stripped(selection: Selection | None) -> Selection | None:
    """``selection`` without its tensors' memory (names, dtypes, shapes and sizes are what a reuse needs)."""
    if selection is None:
        return None
    tensors = tuple(FlatTensor(t.name, t.dtype, t.shape, t.nbytes, _NO_SOURCE) for t in selection.tensors)
    return replace(selection, tensors=tensors)


def _indices(every: list[FlatTensor], some: list[FlatTensor]) -> list[int]:
    """The positions in ``every`` of ``some`` (a subsequence of it)."""
    position = {id(t): i for i, t in enumerate(every)}
    return [position[id(t)] for t in some]


def first_prints(
    state: Any, flat: FlatState, keys: tuple[str, ...], checked: Collection[tuple[str, ...]]
) -> dict[str, str] | None:
    """The fingerprints an async collective save votes with when it is the first to declare ``keys``
    (rank 0 compares every rank's in the vote: collective.merge_parts), else None.

    Computed on the caller's thread, so that every rank fingerprints its state as it is at this save, but local
    (one pass over the replicated tensors' memory): the exchange with the other ranks runs in the background.
    """
    if not keys or keys in checked:
        return None
    return fingerprints(select(state, flat, keys))  # flat's own tensors: a cached selection holds none
