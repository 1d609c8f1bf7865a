"""Flatten a state again by replaying the last flatten of a state of the same structure.

A training loop saves the same structure at every save: the same keys, the same tensors (often new Python
objects over the same memory: ``Module.state_dict()`` detaches every parameter anew), only their bytes and the
plain values (step counters, RNG state, data positions) change. :func:`flatten_layout` flattens a state and
keeps a :class:`Layout` of it; :func:`reflatten` walks a later state like :func:`state.flatten` does, every
plain value encoded afresh, and checks each tensor against the layout instead of identifying it anew: the
same path and the same identity (:func:`state.tensor_identity`: data pointer, shape, dtype, strides, device,
neg/conj bits), visit by visit. Any difference (a key added, removed or renamed, a tensor replaced by one over
other memory, reshaped, cast, moved) gives None, and the caller flattens in full. Equal visits give exactly
what :func:`state.flatten` would, tensor names included, so a plan made for the layout fits the new state.

Scope: recording a flatten's tensor visits, replaying them against a new state. Anti-scope: what a save does
with the result (savelayout.py, saving.py); the encoding itself (state.py).

A layout holds no reference to any tensor (only addresses, shapes and names): keeping it never keeps a
model's memory alive after the model is gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .format.jsonsafe import paused_gc
from .state import _PLAIN_TENSORS, FlatState, FlatTensor, _Flattener, tensor_identity


@dataclass(frozen=True)
class Layout:
    """What a flatten found, without the tensors themselves.

    Attributes:
        paths: the path of every fast-path tensor visit, in walk order.
        keys: each visit's identity (:func:`state.tensor_identity`).
        names: the name each visit resolved to.
        first: for each visit, True when it is the first of its unique tensor (the others are ties).
        specs: per unique tensor ``(name, dtype, shape, nbytes, address)``, in the flattened order.
    """

    paths: list[str]
    keys: list[tuple[Any, ...]]
    names: list[str]
    first: list[bool]
    specs: list[tuple[str, str, tuple[int, ...], int, int | None]]


class _Changed(Exception):
    """The state no longer fits the layout."""


def flatten_layout(state: Any) -> tuple[FlatState, Layout | None]:
    """:func:`state.flatten`, and the layout of the result (None when a replay could not cover it: the state
    holds numpy arrays or tensors without memory)."""
    f = _Flattener()
    with paused_gc():
        tree = f.encode(state, "")
        flat = FlatState(tree, f.tensors)
        if not f.replayable:
            return flat, None
        name_of = f._by_identity
        seen: set[str] = set()
        names, first = [], []
        for _, key in f.visits:
            name = name_of[key]
            names.append(name)
            first.append(name not in seen)
            seen.add(name)
        layout = Layout(
            [p for p, _ in f.visits],
            [k for _, k in f.visits],
            names,
            first,
            [(t.name, t.dtype, t.shape, t.nbytes, t.address) for t in f.tensors],
        )
    return flat, layout


def reflatten(state: Any, layout: Layout) -> FlatState | None:
    """``state`` flattened by replaying ``layout``; None when ``state`` does not have that layout (then
    :func:`flatten_layout` it). Plain values are always encoded afresh; stateful objects give their
    ``state_dict()`` afresh."""
    r = _Replayer(layout)
    with paused_gc():
        try:
            tree = r.encode(state, "")
        except _Changed:
            return None
        if r.index != len(layout.keys):  # tensors the layout has are gone
            return None
        sources = r.sources
        tensors = [
            FlatTensor(name, dtype, shape, nbytes, source, address)
            for (name, dtype, shape, nbytes, address), source in zip(layout.specs, sources)
        ]
    return FlatState(tree, tensors)


class _Replayer(_Flattener):
    """A flattener that checks each tensor visit against a layout rather than identifying the tensor."""

    def __init__(self, layout: Layout) -> None:
        super().__init__()
        self._paths, self._keys, self._resolved, self._first = layout.paths, layout.keys, layout.names, layout.first
        self._count = len(layout.keys)
        self.index = 0
        self.sources: list[torch.Tensor | np.ndarray] = []

    def tensor(self, t: torch.Tensor, path: str) -> str:
        i = self.index
        # Same path and same identity at every visit: the walk, the ties and so the names are flatten's.
        if i >= self._count or type(t) not in _PLAIN_TENSORS or path != self._paths[i]:
            raise _Changed
        if tensor_identity(t) != self._keys[i]:
            raise _Changed
        self.index = i + 1
        if self._first[i]:  # unique tensors are first visited in their flattened order
            self.sources.append(t)
        return self._resolved[i]

    def ndarray(self, a: np.ndarray, path: str) -> str:
        raise _Changed  # a layout has none (flatten_layout gives none for a state with arrays)
