"""Flatten a state again by replaying the last flatten of a state of the same structure.

A training loop saves the same structure at every save: the same keys, the same tensors (often new Python
objects over the same memory: ``Module.state_dict()`` detaches every parameter anew), only their bytes and the
plain values (step counters, RNG state, data positions) change. :func:`flatten_layout` flattens a state and
records a :class:`Layout` of it: a template of its containers (their classes, keys and lengths, where the
tensors are) and, per tensor visit, the identity :func:`state.tensor_identity` gave (data pointer, shape,
dtype, strides, device, neg/conj bits). :func:`reflatten` walks a later state along the template, container by
container, and then checks every tensor against the recorded identities in bulk (one ``map`` over all the
tensors per attribute, compared as lists). Any difference (a key added, removed or renamed, a container of
another class, a tensor replaced by one over other memory, reshaped, cast, moved, made a view with other
strides, a tie made or broken, a tensor where a plain value was or the reverse) gives None, and the caller
flattens in full. Equal states give exactly what :func:`state.flatten` would, tensor names included, so a plan
made for the layout fits the new state.

Why a template: checking tensor by tensor (its path string, its identity tuple, a ``FlatTensor``) costs 4-5 us
per tensor in Python, more than the target for a whole ``save_async``; along the template, a container whose
values are all tensors costs a few C-level calls (its keys as a tuple, its values' types) whatever its size, and
its encoding, which only names tensors, is the one recorded: reused as it is.

Scope: recording a flatten's template, replaying it against a new state. Anti-scope: what a save does with the
result (savelayout.py, saving.py); the encoding itself (state.py).

A layout holds no reference to any tensor (only addresses, shapes, classes and the encoded tree): keeping it
never keeps a model's memory alive after the model is gone. The encoded subtrees it reuses are shared by the
trees of successive saves: a ``FlatState.tree`` is never changed in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, compress
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from .errors import UnsupportedStateError
from .format import tree as T
from .format.jsonsafe import paused_gc
from .state import _PLAIN_TENSORS, Columns, FlatState, _Flattener, is_stateful

_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_is_neg = torch.Tensor.is_neg
_dtype = attrgetter("dtype")
_size = torch.Tensor.size  # the same torch.Size as .shape, read faster
_is_cpu = attrgetter("is_cpu")
_device = attrgetter("device")


class _Changed(Exception):
    """The state no longer fits the layout."""


# ---------------------------------------------------------------------------------------------------
# the template: one node per container that holds tensors, per tensor, and per value without tensors


class _Node:
    """What the flatten found at one place of the state. ``tensors``: the subtree holds a tensor; ``const``: its
    encoding depends on nothing but the layout (no plain value below), so :attr:`encoded` is reused."""

    __slots__ = ("const", "encoded", "tensors")

    def __init__(self, tensors: bool, const: bool, encoded: Any = None) -> None:
        self.tensors = tensors
        self.const = const
        self.encoded = encoded

    def replay(self, obj: Any, run: _Run) -> Any:  # pragma: no cover (every node overrides it)
        raise NotImplementedError


class _Plain(_Node):
    """A value without tensors (a number, a string, a dict of them): encoded afresh at every save."""

    __slots__ = ("depth", "path")

    def __init__(self, path: str, depth: int) -> None:
        super().__init__(False, False)
        self.path = path
        self.depth = depth

    def replay(self, obj: Any, run: _Run) -> Any:
        return run.plain.at(obj, self.path, self.depth)


class _Leaf(_Node):
    """One tensor visit (its identity is checked in bulk afterwards: :func:`_same_tensors`)."""

    __slots__ = ("cls",)

    def __init__(self, cls: type) -> None:
        super().__init__(True, True)
        self.cls = cls

    def replay(self, obj: Any, run: _Run) -> Any:
        if type(obj) is not self.cls:
            raise _Changed
        run.tensors.append(obj)
        return self.encoded


class _Container(_Node):
    """A dict, list or tuple that holds tensors: the same class, the same keys (of the same types) or length.

    ``simple``: every value is a tensor; then one comparison of the values' classes stands for the values, and
    the encoded entries (which only name tensors) are the recorded ones."""

    __slots__ = (
        "children",
        "cls",
        "ekeys",
        "entries",
        "form",
        "keys",
        "keytypes",
        "meta",
        "records",
        "sigs",
        "simple",
        "types",
    )

    def __init__(self, obj: Any, children: list[_Node], entries: Any, meta: _Node | None, form: str) -> None:
        super().__init__(True, all(c.const for c in children) and (meta is None or meta.const))
        self.cls = type(obj)
        self.form = form  # "str" (a dict of str keys), "dict" (other keys: $dict pairs), "list", "tuple"
        keyed = form in ("str", "dict")
        self.keys: tuple[Any, ...] | None = tuple(obj) if keyed else None
        self.keytypes = tuple(map(type, obj)) if keyed else ()
        # float and tuple keys: equal keys may differ in their text (-0.0 and 0.0) or their items' types
        plain_keys = {int, str, bool}.issuperset(self.keytypes)
        self.sigs = None if plain_keys else tuple(map(_key_sig, obj))
        self.children = children
        self.simple = all(type(c) is _Leaf for c in children)
        self.types = tuple(c.cls for c in children if isinstance(c, _Leaf)) if self.simple else ()
        # values that are all plain dicts of tensors under str keys (an optimizer's state, one per parameter):
        # their keys and their tensors' classes, checked at once
        self.records: tuple[list[tuple[Any, ...]], tuple[type, ...]] | None = None
        if not self.simple and all(
            type(c) is _Container and c.cls is dict and c.form == "str" and c.simple for c in children
        ):
            inner = [c for c in children if isinstance(c, _Container)]
            self.records = ([c.keys or () for c in inner], tuple(t for c in inner for t in c.types))
        self.entries = entries  # the encoded entries (items of a sequence), without the $statedict wrapper
        self.ekeys: list[Any] = (
            list(entries) if form == "str" else [p[0] for p in entries[T.T_DICT]] if form == "dict" else []
        )
        self.meta = meta

    def replay(self, obj: Any, run: _Run) -> Any:
        if type(obj) is not self.cls:
            raise _Changed
        keys = self.keys
        if keys is None:
            if len(obj) != len(self.children):
                raise _Changed
            values = obj
        else:
            if tuple(obj) != keys or tuple(map(type, obj)) != self.keytypes:
                raise _Changed
            if self.sigs is not None and tuple(map(_key_sig, obj)) != self.sigs:
                raise _Changed
            values = obj.values()
        outs: list[Any] | None = None
        if self.simple:
            values = list(values)
            if tuple(map(type, values)) != self.types:
                raise _Changed
            run.tensors += values
        elif self.records is not None:
            _records(list(values), self.records, run)
            outs = [c.encoded for c in self.children]
        else:
            outs = [child.replay(v, run) for child, v in zip(self.children, values)]
        if keys is None:
            if self.const:
                return self.encoded
            return outs if self.form == "list" else {T.T_TUPLE: outs}
        meta = getattr(obj, "_metadata", None) if self.cls is not dict else None  # a dict has no attributes
        if (meta is None) is not (self.meta is None):
            raise _Changed
        if self.const:
            return self.encoded
        if outs is None:
            entries = self.entries
        elif self.form == "str":
            entries = dict(zip(self.ekeys, outs))
        else:
            entries = {T.T_DICT: [[k, v] for k, v in zip(self.ekeys, outs)]}
        if self.meta is None:
            return entries
        return {T.T_STATEDICT: {"entries": entries, "metadata": self.meta.replay(meta, run)}}


def _records(values: list[Any], records: tuple[list[tuple[Any, ...]], tuple[type, ...]], run: _Run) -> None:
    """Replay values that were all plain dicts of tensors (``records``: their keys, their tensors' classes)."""
    keys, types = records
    if {*map(type, values)} != {dict} or list(map(tuple, values)) != keys:
        raise _Changed
    if {*map(type, chain.from_iterable(values))} - {str}:  # a key of a str subclass: the flatten refuses it
        raise _Changed
    tensors = list(chain.from_iterable(map(dict.values, values)))
    if tuple(map(type, tensors)) != types:
        raise _Changed
    run.tensors += tensors


class _Stateful(_Node):
    """An object saved through its ``state_dict()``: the same class, its state replayed."""

    __slots__ = ("child", "cls", "kind")

    def __init__(self, obj: Any, child: _Node, encoded: Any) -> None:
        super().__init__(True, child.const, encoded)
        self.cls = type(obj)
        self.kind = encoded[T.T_STATEFUL]["type"]
        self.child = child

    def replay(self, obj: Any, run: _Run) -> Any:
        if type(obj) is not self.cls or not is_stateful(obj):
            raise _Changed
        out = self.child.replay(obj.state_dict(), run)
        return self.encoded if self.const else {T.T_STATEFUL: {"type": self.kind, "state": out}}


def _key_sig(key: Any) -> Any:
    """A dict key as exactly as the flatten sees it (its path text and encoding)."""
    if type(key) is tuple:
        return (tuple, tuple(map(_key_sig, key)))
    return (type(key), repr(key))


# ---------------------------------------------------------------------------------------------------
# recording: a flatten that builds the template as it goes


class _Recorder(_Flattener):
    """:class:`state._Flattener` that also builds the template of what it encodes.

    Every :meth:`encode` call opens a frame; the nodes of what it encodes inside (values, keys, tensors met
    through :meth:`tensor` directly) land in that frame in walk order, and close into one node."""

    def __init__(self) -> None:
        super().__init__()
        self._frames: list[list[_Node]] = [[]]
        self._inside = 0  # tensor() is re-entered from _checked for a dtype seen the first time
        self.met: list[torch.Tensor] = []  # the tensor of every visit (only while flattening)

    def tensor(self, t: torch.Tensor, path: str) -> str:
        outer = not self._inside
        self._inside += 1
        try:
            name = super().tensor(t, path)
        finally:
            self._inside -= 1
        if outer:
            self._frames[-1].append(_Leaf(type(t)))
            self.met.append(t)
        return name

    def encode(self, obj: Any, path: str) -> Any:
        depth = self._depth
        self._frames.append([])
        try:
            out = super().encode(obj, path)
        finally:
            inner = self._frames.pop()
        self._frames[-1].append(_node(obj, out, inner, path, depth))
        return out


def _node(obj: Any, out: Any, inner: list[_Node], path: str, depth: int) -> _Node:
    """The node of ``obj``, encoded as ``out``, from the nodes met inside it."""
    if not any(c.tensors for c in inner):
        return _Plain(path, depth)
    if type(obj) in _PLAIN_TENSORS or isinstance(obj, torch.Tensor):
        (leaf,) = inner
        leaf.encoded = out
        return leaf
    if isinstance(obj, dict):
        wrapped = getattr(obj, "_metadata", None) is not None  # then the last node inside is the metadata's
        entries = out[T.T_STATEDICT]["entries"] if wrapped else out
        meta = inner.pop() if wrapped else None
        if all(type(k) is str for k in obj):
            for leaf, encoded in zip(inner, entries.values()):
                if type(leaf) is _Leaf:  # a tensor value, met through tensor() directly
                    leaf.encoded = encoded
            node = _Container(obj, inner, entries, meta, "str")
        else:
            node = _Container(obj, inner[1::2], entries, meta, "dict")  # inner: key, value, key, value...
    elif isinstance(obj, (list, tuple)):
        items = out if isinstance(obj, list) else out[T.T_TUPLE]
        node = _Container(obj, inner, items, None, "list" if isinstance(obj, list) else "tuple")
    else:  # a stateful object: its state is the one value inside
        (child,) = inner
        return _Stateful(obj, child, out)
    node.encoded = out
    return node


# ---------------------------------------------------------------------------------------------------
# the layout, and replaying it


@dataclass(frozen=True)
class Layout:
    """What a flatten found, without the tensors themselves.

    Attributes:
        root: the template of the state.
        count: the tensor visits, in walk order; per visit: ``ptrs``, ``shapes``, ``dtypes``, ``contiguous``;
            ``strides`` of the non-contiguous visits, ``negs`` (None: no visit had the bit), ``conjs`` of the
            complex visits, ``devices`` (None: all on the CPU).
        first: per visit, True when it is the first of its unique tensor (None: no ties).
        columns: the unique tensors' names, dtypes, shapes, sizes and addresses (:class:`state.Columns`, its
            ``sources`` empty).
    """

    root: _Node
    count: int
    ptrs: list[int]
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    contiguous: list[bool]
    strides: dict[int, tuple[int, ...]]
    negs: list[bool] | None
    conjs: dict[int, bool]
    devices: list[torch.device | None] | None
    first: list[bool] | None
    columns: Columns


def flatten_layout(state: Any) -> tuple[FlatState, Layout | None]:
    """:func:`state.flatten`, and the layout of the result (None when a replay could not cover it: the state
    holds numpy arrays or tensors without memory)."""
    f = _Recorder()
    with paused_gc():
        tree = f.encode(state, "")
        flat = FlatState(tree, f.tensors)
        if not f.replayable:
            return flat, None
        (root,) = f._frames[0]
        keys = [k for _, k in f.visits]
        name_of = f._by_identity
        seen: set[str] = set()
        first = []
        for key in keys:
            name = name_of[key]
            first.append(name not in seen)
            seen.add(name)
        ts = flat.tensors
        layout = Layout(
            root=root,
            count=len(keys),
            ptrs=[k[0] for k in keys],
            shapes=[k[1] for k in keys],
            dtypes=list(map(_dtype, f.met)),
            contiguous=[k[5] is None for k in keys],
            strides={i: k[5] for i, k in enumerate(keys) if k[5] is not None},
            negs=[k[3] for k in keys] if any(k[3] for k in keys) else None,
            conjs={i: k[4] for i, k in enumerate(keys) if k[2].startswith("complex")},
            devices=list(map(_device, f.met)) if any(k[6] is not None for k in keys) else None,
            first=None if all(first) else first,
            columns=Columns(
                [t.name for t in ts],
                [t.dtype for t in ts],
                [t.shape for t in ts],
                [t.nbytes for t in ts],
                [],
                [t.address for t in ts],
            ),
        )
    return flat, layout


def reflatten(state: Any, layout: Layout) -> FlatState | None:
    """``state`` flattened by replaying ``layout``; None when ``state`` does not have that layout (then
    :func:`flatten_layout` it). Plain values are always encoded afresh; stateful objects give their
    ``state_dict()`` afresh."""
    run = _Run()
    with paused_gc():
        try:
            tree = layout.root.replay(state, run)
        except (_Changed, UnsupportedStateError):  # a full flatten raises such an error with its own path
            return None
    tensors = run.tensors
    if not _same_tensors(tensors, layout):
        return None
    sources = tensors if layout.first is None else list(compress(tensors, layout.first))
    return FlatState(tree, columns=layout.columns._replace(sources=sources))


def _same_tensors(ts: list[torch.Tensor], lay: Layout) -> bool:
    """Every visit's tensor has the identity recorded for it (:func:`state.tensor_identity`), attribute by
    attribute over all the visits at once."""
    if len(ts) != lay.count:
        return False
    try:
        if list(map(_data_ptr, ts)) != lay.ptrs:  # raises for tensors without storage (sparse)
            return False
    except RuntimeError:
        return False
    if list(map(_dtype, ts)) != lay.dtypes or list(map(_size, ts)) != lay.shapes:
        return False
    if list(map(_is_contiguous, ts)) != lay.contiguous:
        return False
    if any(ts[i].stride() != s for i, s in lay.strides.items()):
        return False
    if (not all(map(_is_cpu, ts))) if lay.devices is None else (list(map(_device, ts)) != lay.devices):
        return False
    if lay.negs is None:
        if any(map(_is_neg, ts)):
            return False
    elif list(map(_is_neg, ts)) != lay.negs:
        return False
    return all(ts[i].is_conj() == c for i, c in lay.conjs.items())


class _Run:
    """One replay: the tensors met, in visit order, and the encoder of the values without tensors."""

    __slots__ = ("plain", "tensors")

    def __init__(self) -> None:
        self.tensors: list[Any] = []  # torch.Tensor each (the replay checked their classes)
        self.plain = _PlainEncoder()


class _PlainEncoder(_Flattener):
    """Encodes a value the layout holds no tensor in; a tensor or an array found there is a change."""

    def at(self, obj: Any, path: str, depth: int) -> Any:
        self._depth = depth  # as deep as the flatten met it: its depth cap holds alike
        return self.encode(obj, path)

    def tensor(self, t: torch.Tensor, path: str) -> str:
        raise _Changed

    def ndarray(self, a: np.ndarray, path: str) -> str:
        raise _Changed
