"""Flatten a training state into tensors plus a JSON tree, and rebuild it (docs/format.md section 5).

Scope: the mapping between Python/torch/numpy objects and the format's tree and tensor table, and applying
a restored tree to a live state (``load_state_dict``, in-place dict/list updates).
Anti-scope: I/O, checksums, staging buffers; which live tensor each stored tensor lands in (destinations.py).

Supported values: dict (any hashable scalar keys), list, tuple, None, bool, int, float (incl. NaN/inf),
str, bytes, torch tensors of every dtype with a byte view (non-contiguous, views, 0-d and empty ones
included), numpy arrays and scalars of numeric dtypes, ``torch.dtype``, and any object with
``state_dict()`` and ``load_state_dict()`` (models, optimizers, schedulers, data-loader state, RNGState).
Anything else raises :class:`UnsupportedStateError` naming its path. Nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from .errors import StateMismatchError, UnsupportedStateError
from .format import tree as T
from .format.dtypes import NUMPY_TO_NAME, lookup
from .format.jsonsafe import paused_gc

# ---------------------------------------------------------------------------------------------------
# dtypes


def torch_dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is not None:
        return name
    name = str(dtype).removeprefix("torch.")
    if lookup(name) is None:
        raise UnsupportedStateError(f"tensor dtype {dtype} cannot be stored (quantized dtypes are not supported)")
    _DTYPE_NAMES[dtype] = name
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# accepted dtypes (not quantized): their stored name, element size and whether they are complex
_FAST_DTYPES: dict[torch.dtype, tuple[str, int, bool]] = {}
_SELF_ENCODED = frozenset({int, str, bool, type(None)})  # the values whose encoding is the value itself


def tensor_identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What fixes which bytes a plain tensor's save holds and how they are laid out: ``(data_ptr, shape, dtype
    name, neg bit, conj bit, strides or None when contiguous, device or None on the CPU)``. Two tensors with the
    same identity are saved once (tied weights, views of one tensor). None: not on the fast path (a dtype not
    accepted yet, no memory: an empty, meta or sparse tensor); :meth:`_Flattener._checked` then decides.

    Each read costs 0.1-0.3 us and a state may hold 10^5 tensors: as few reads as identify it exactly.
    """
    fast = _FAST_DTYPES.get(t.dtype)
    if fast is None:
        return None
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # every layout but strided (sparse, mkldnn) has none: the checks name it
        return None
    if not ptr:  # also 0 for an empty or a meta tensor
        return None
    return (
        ptr,
        t.shape,  # a torch.Size is a tuple: no copy
        fast[0],
        t.is_neg(),
        fast[2] and t.is_conj(),  # only complex tensors carry the conjugate bit
        # a contiguous view is fixed by where it starts, its shape and dtype; others need strides
        None if t.is_contiguous() else t.stride(),
        None if t.is_cpu else t.device,  # (a torch.device's .type costs more than is_cpu)
    )


def torch_dtype(name: str) -> torch.dtype:
    value = _TORCH_DTYPES.get(name)  # (once per stored tensor at a restore)
    if value is None:
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype):
            raise UnsupportedStateError(f"this torch ({torch.__version__}) has no dtype {name!r}")
        _TORCH_DTYPES[name] = value
    return value


_TORCH_DTYPES: dict[str, torch.dtype] = {}


def is_stateful(obj: Any) -> bool:
    """An object saved through its ``state_dict()`` and restored through ``load_state_dict()``."""
    return (
        not isinstance(obj, (dict, list, tuple, torch.Tensor, np.ndarray))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


_ARRAYS = (torch.Tensor, np.ndarray)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as a same-width integer tensor (same memory, same strides).

    Copies go through this view: several dtypes (``int1``.., ``bits8``, some float8) have no copy kernel,
    but every integer dtype does, and a bit-for-bit copy is what a checkpoint needs anyway.
    """
    bits = _BITS.get(t.element_size())
    return t if bits is None or t.dtype == bits else t.view(bits)


def tensor_byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU, contiguous tensor as a flat ``memoryview`` sharing its memory."""
    if t.numel() == 0:
        return memoryview(b"")
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


def ndarray_byte_view(a: np.ndarray) -> memoryview:
    if a.size == 0:
        return memoryview(b"")
    return a.reshape(-1).view(np.uint8).data


# ---------------------------------------------------------------------------------------------------
# save: state -> tree + tensor table


@dataclass(slots=True)
class FlatTensor:
    """One unique tensor of a flattened state (tensors sharing memory appear once)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    source: torch.Tensor | np.ndarray
    address: int | None = None
    """Where the bytes lie when they can be copied as they are (host memory, contiguous, no conj/neg bit),
    read while flattening so that staging need not read it again; None: the stager makes a byte view."""


class Columns(NamedTuple):
    """A flattened state's unique tensors as columns, one entry per tensor in the flattened order (what a
    replayed layout gives: reflatten.py); each ``FlatTensor`` is made only when asked for."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    nbytes: list[int]
    sources: list[torch.Tensor | np.ndarray]
    addresses: list[int | None]


class FlatState:
    """A state as its JSON tree and the unique tensors it references, in order: either as :class:`FlatTensor`
    objects (``flatten``) or as :class:`Columns` (a replay), whose ``FlatTensor`` objects are made on the first
    read of :attr:`tensors`. A save of 10^5 tensors reads only :attr:`sources` and :attr:`addresses`: no
    object per tensor on the caller's thread.

    The tree may share subtrees with an earlier save's (reflatten.py): it is never changed in place."""

    __slots__ = ("_columns", "_tensors", "tree")

    def __init__(self, tree: Any, tensors: list[FlatTensor] | None = None, *, columns: Columns | None = None) -> None:
        self.tree = tree
        self._tensors = tensors if tensors is not None or columns is not None else []
        self._columns = columns

    @property
    def tensors(self) -> list[FlatTensor]:
        if self._tensors is None:
            c = self._columns
            assert c is not None
            self._tensors = list(map(FlatTensor, c.names, c.dtypes, c.shapes, c.nbytes, c.sources, c.addresses))
        return self._tensors

    @property
    def sources(self) -> list[torch.Tensor | np.ndarray]:
        """Each unique tensor's value (``FlatTensor.source``)."""
        if self._columns is not None:
            return self._columns.sources
        return [t.source for t in self.tensors]

    @property
    def addresses(self) -> list[int | None]:
        """Each unique tensor's host address when its bytes can be copied as they lie (``FlatTensor.address``)."""
        if self._columns is not None:
            return self._columns.addresses
        return [t.address for t in self.tensors]

    @property
    def nbytes(self) -> int:
        return sum(self._columns.nbytes) if self._columns is not None else sum(t.nbytes for t in self.tensors)


def _path_join(path: str, key: Any) -> str:
    part = key if isinstance(key, str) else str(key)
    return f"{path}.{part}" if path else part


class _Flattener:
    def __init__(self) -> None:
        self.tensors: list[FlatTensor] = []
        self._by_identity: dict[tuple[Any, ...], str] = {}
        self._names: set[str] = set()
        self._active: set[int] = set()  # containers on the current path, to reject cycles
        self._depth = 0  # the decoder's nesting level of the value being encoded
        # Every visit of a fast-path tensor, in walk order: its path and identity (reflatten.py replays them);
        # False once a tensor took another path (an empty one, an array), which a replay does not cover.
        self.visits: list[tuple[str, tuple[Any, ...]]] = []
        self.replayable = True

    def _unique_name(self, path: str) -> str:
        name = path or "tensor"
        if name in self._names:
            n = 2
            while f"{name}#{n}" in self._names:
                n += 1
            name = f"{name}#{n}"
        self._names.add(name)
        return name

    def _add(self, key: tuple[Any, ...], path: str, make: Callable[[str], FlatTensor]) -> str:
        existing = self._by_identity.get(key)
        if existing is not None:
            return existing
        flat = make(self._unique_name(path))
        self.tensors.append(flat)
        self._by_identity[key] = flat.name
        return flat.name

    def tensor(self, t: torch.Tensor, path: str) -> str:
        # A mixture-of-experts state has 10^5 tensors: every attribute read here is paid per tensor (each
        # 0.1-0.3 us, a Python call more), so the common plain tensor takes one inline path of as few reads
        # as identify it exactly; anything else goes through every check (_checked).
        if type(t) in _PLAIN_TENSORS:
            key = tensor_identity(t)
            if key is not None:  # a dtype seen before and accepted, with memory: the fast path
                self.visits.append((path, key))
                existing = self._by_identity.get(key)
                if existing is not None:
                    return existing
                names = self._names
                if path and path not in names:
                    names.add(path)
                    name = path
                else:
                    name = self._unique_name(path)
                ptr, shape, dtype, neg, conj, stride, device = key
                plain = stride is None and device is None and not neg and not conj
                nbytes = t.numel() * _FAST_DTYPES[t.dtype][1]
                self.tensors.append(FlatTensor(name, dtype, shape, nbytes, t, ptr if plain else None))
                self._by_identity[key] = name
                return name
        return self._checked(t, path)

    def _checked(self, t: torch.Tensor, path: str) -> str:
        """Every check, each with its error; then the identity of the tensor's view."""
        if t.layout != torch.strided:
            raise UnsupportedStateError(
                f"{path or 'state'}: {t.layout} tensors are not supported; convert with .to_dense()",
                path=path,
            )
        if t.is_quantized:
            raise UnsupportedStateError(
                f"{path or 'state'}: quantized tensors are not supported; save int_repr(), scale and zero point",
                path=path,
            )
        if t.is_meta:
            raise UnsupportedStateError(f"{path or 'state'}: a meta tensor has no data to save", path=path)
        if type(t) not in _PLAIN_TENSORS:
            raise UnsupportedStateError(
                f"{path or 'state'}: tensor subclass {type(t).__name__} is not supported", path=path
            )
        dtype = _DTYPE_NAMES.get(t.dtype) or torch_dtype_name(t.dtype)
        _FAST_DTYPES.setdefault(t.dtype, (dtype, t.element_size(), t.is_complex()))
        nbytes = t.nbytes
        if nbytes and t.data_ptr():  # it passes the checks: the fast path takes it from now on
            return self.tensor(t, path)
        # an empty tensor has no memory, only an offset
        self.replayable = False
        shape = tuple(t.shape)
        key = ("at", t.device, -1 - t.storage_offset(), shape, t.stride(), dtype, t.is_conj(), t.is_neg())
        existing = self._by_identity.get(key)
        if existing is not None:
            return existing
        flat = FlatTensor(self._unique_name(path), dtype, shape, nbytes, t)
        self.tensors.append(flat)
        self._by_identity[key] = flat.name
        return flat.name

    def ndarray(self, a: np.ndarray, path: str) -> str:
        self.replayable = False
        name_of = NUMPY_TO_NAME.get(a.dtype.name)
        if name_of is None or a.dtype.kind not in "biufc":
            raise UnsupportedStateError(
                f"{path or 'state'}: numpy dtype {a.dtype} is not supported (numeric dtypes only)", path=path
            )
        if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and np.little_endian is False):
            a = a.astype(a.dtype.newbyteorder("<"))
        shape = tuple(int(s) for s in a.shape)
        ptr = int(a.__array_interface__["data"][0])
        key = ("n", ptr, shape, a.strides, name_of)
        address = ptr if a.flags.c_contiguous else None
        return self._add(key, path, lambda name: FlatTensor(name, name_of, shape, a.nbytes, a, address))

    def encode(self, obj: Any, path: str) -> Any:
        if type(obj) in _PLAIN_TENSORS:  # the common leaf first
            return {T.T_TENSOR: self.tensor(obj, path)}
        if obj is None or (isinstance(obj, (bool, str)) and type(obj) in (bool, str)):
            return obj
        if isinstance(obj, np.generic):
            return self._npscalar(obj, path)
        if type(obj) is int:
            return obj
        if type(obj) is float:
            return T.encode_float(obj)
        if isinstance(obj, torch.Tensor):
            return {T.T_TENSOR: self.tensor(obj, path)}
        if isinstance(obj, np.ndarray):
            return {T.T_NDARRAY: self.ndarray(obj, path)}
        if isinstance(obj, torch.dtype):
            return {T.T_DTYPE: torch_dtype_name(obj)}
        if isinstance(obj, (bytes, bytearray)):
            return T.encode_bytes(bytes(obj))
        if isinstance(obj, (dict, list, tuple)):
            if id(obj) in self._active:
                raise UnsupportedStateError(f"{path or 'state'}: the state contains a cycle", path=path)
            # a state dict with torch's _metadata is wrapped in a tag: one more level for the decoder
            levels = 2 if isinstance(obj, dict) and getattr(obj, "_metadata", None) is not None else 1
            self._enter(levels, path)
            self._active.add(id(obj))
            try:
                return self._container(obj, path)
            finally:
                self._active.discard(id(obj))
                self._depth -= levels
        if is_stateful(obj):
            state = obj.state_dict()
            kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
            self._enter(1, path)
            try:
                return {T.T_STATEFUL: {"type": kind[:256], "state": self.encode(state, path)}}
            finally:
                self._depth -= 1
        raise UnsupportedStateError(
            f"{path or 'state'}: cannot save an object of type {type(obj).__module__}.{type(obj).__qualname__}; "
            "give it state_dict()/load_state_dict(), or convert it to tensors, numbers, strings, lists or dicts",
            path=path,
        )

    def _enter(self, levels: int, path: str) -> None:
        if self._depth + levels > T.MAX_TREE_DEPTH:
            where = path if len(path) <= 80 else "..." + path[-77:]
            raise UnsupportedStateError(
                f"{where or 'state'}: the state nests deeper than {T.MAX_TREE_DEPTH} levels", path=path
            )
        self._depth += levels

    def _npscalar(self, obj: np.generic, path: str) -> Any:
        name = NUMPY_TO_NAME.get(obj.dtype.name)
        if name is None or obj.dtype.kind not in "biufc":
            raise UnsupportedStateError(
                f"{path or 'state'}: numpy scalar of dtype {obj.dtype} is not supported", path=path
            )
        raw = np.asarray(obj).astype(obj.dtype.newbyteorder("<")).tobytes()
        return {T.T_NPSCALAR: {"dtype": name, "hex": raw.hex()}}

    def _container(self, obj: dict[Any, Any] | list[Any] | tuple[Any, ...], path: str) -> Any:
        if isinstance(obj, dict):
            metadata = getattr(obj, "_metadata", None)
            if all(type(k) is str for k in obj):
                encoded: Any = {}
                tensor, tag = self.tensor, T.T_TENSOR
                for k, v in obj.items():  # a state dict's tensors inline: 10^5 of them in an MoE model
                    sub = f"{path}.{k}" if path else k
                    key = T.escape_key(k) if k.startswith("$") else k
                    encoded[key] = {tag: tensor(v, sub)} if type(v) in _PLAIN_TENSORS else self.encode(v, sub)
            else:
                pairs = []
                for k, v in obj.items():
                    self._check_key(k, path)
                    pairs.append([self.encode(k, path), self.encode(v, _path_join(path, k))])
                encoded = {T.T_DICT: pairs}
            if metadata is not None:
                return {T.T_STATEDICT: {"entries": encoded, "metadata": self.encode(metadata, path)}}
            return encoded
        if _SELF_ENCODED.issuperset(map(type, obj)):  # e.g. an optimizer's parameter indices: one per parameter
            items = list(obj)
        else:
            items = [self.encode(v, _path_join(path, i)) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {T.T_TUPLE: items}

    def _check_key(self, key: Any, path: str) -> None:
        if isinstance(key, tuple):
            for k in key:
                self._check_key(k, path)
        elif not (key is None or type(key) in (bool, int, float, str)):
            raise UnsupportedStateError(
                f"{path or 'state'}: dict key {key!r} of type {type(key).__name__} cannot be saved "
                "(keys must be None, bool, int, float, str or tuples of those)",
                path=path,
            )


def flatten(state: Any) -> FlatState:
    """Encode ``state`` as a JSON tree plus the list of unique tensors it references."""
    f = _Flattener()
    with paused_gc():
        tree = f.encode(state, "")
    return FlatState(tree, f.tensors)


# ---------------------------------------------------------------------------------------------------
# restore: plan destinations, then build the tree


@dataclass(slots=True)
class _Ref:
    """Placeholder for a stored tensor while matching a saved tree against a live state."""

    name: str
    kind: str  # "tensor" or "ndarray"


@dataclass
class _StatefulNode:
    type_name: str
    state: Any


class _PlaceholderHooks:
    def tensor(self, name: str, path: str) -> Any:
        return _Ref(name, "tensor")

    def ndarray(self, name: str, path: str) -> Any:
        return _Ref(name, "ndarray")

    def npscalar(self, dtype: str, raw: bytes, path: str) -> Any:
        return np.frombuffer(raw, dtype=np.dtype(lookup(dtype).numpy).newbyteorder("<"))[0]  # type: ignore[union-attr, arg-type]

    def dtype(self, name: str, path: str) -> Any:
        return torch_dtype(name)

    def stateful(self, type_name: str, state: Any, path: str) -> Any:
        return _StatefulNode(type_name, state)

    def statedict(self, entries: dict[Any, Any], metadata: Any, path: str) -> Any:
        from collections import OrderedDict

        out: OrderedDict[Any, Any] = OrderedDict(entries)
        out._metadata = metadata  # type: ignore[attr-defined]
        return out


def decode_placeholders(tree: Any) -> Any:
    """Decode a manifest tree with tensors left as placeholders (to be matched, then filled)."""
    return T.TreeDecoder(_PlaceholderHooks()).decode(tree)


def fill_tree(saved: Any, values: dict[str, Any]) -> Any:
    """Replace placeholders with restored values; stateful nodes become their plain state."""
    if isinstance(saved, _Ref):
        v = values[saved.name]
        if saved.kind == "ndarray" and isinstance(v, torch.Tensor):
            return v.numpy()
        if saved.kind == "tensor" and isinstance(v, np.ndarray):
            return torch.from_numpy(v)
        return v
    if isinstance(saved, _StatefulNode):
        return fill_tree(saved.state, values)
    if isinstance(saved, dict):
        out = type(saved)() if type(saved) is not dict else {}
        for k, v in saved.items():
            if type(v) is _Ref and v.kind == "tensor":  # a tensor's leaf (most of a state), inline
                value = values[v.name]
                out[k] = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
            else:
                out[k] = fill_tree(v, values)
        if hasattr(saved, "_metadata"):
            out._metadata = saved._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(saved, list):
        return [fill_tree(v, values) for v in saved]
    if isinstance(saved, tuple):
        return tuple(fill_tree(v, values) for v in saved)
    return saved


def _load(obj: Any, state: Any, path: str) -> None:
    obj.load_state_dict(state)


def apply_into(
    saved: Any, into: Any, values: dict[str, Any], path: str = "", load: Callable[[Any, Any, str], None] = _load
) -> Any:
    """Load the restored tree into ``into`` in place and return the merged object.

    Stateful objects get ``load_state_dict`` with their restored state (also when the checkpoint holds
    a plain state dict, e.g. saved from ``model.state_dict()``), through ``load(obj, state, path)``; dicts and
    lists are updated in place; tensors already hold their data (they were read or copied into before this runs).
    """
    if is_stateful(into) and not isinstance(saved, _Ref):
        state = fill_tree(saved.state if isinstance(saved, _StatefulNode) else saved, values)
        try:
            load(into, state, path)
        except Exception as exc:  # the object's own validation (shape mismatch, missing keys)
            raise StateMismatchError(
                f"{path or 'state'}: {type(into).__name__}.load_state_dict rejected the checkpoint: {exc}"
            ) from exc
        return into
    if isinstance(saved, _Ref):
        if isinstance(into, (torch.Tensor, np.ndarray)):
            return into  # filled in place (or copied into) already
        return fill_tree(saved, values)
    if isinstance(saved, _StatefulNode):
        return apply_into(saved.state, into, values, path, load)
    if isinstance(saved, dict) and isinstance(into, dict):
        for k, v in saved.items():
            if k not in into:
                into[k] = fill_tree(v, values)
                continue
            live = into[k]
            # a tensor's leaf (most of a state): filled in place (or copied into) already
            into[k] = (
                live
                if type(v) is _Ref and isinstance(live, _ARRAYS)
                else apply_into(v, live, values, _path_join(path, k), load)
            )
        return into
    if isinstance(saved, list) and isinstance(into, list) and len(saved) == len(into):
        for i, v in enumerate(saved):
            into[i] = apply_into(v, into[i], values, _path_join(path, i), load)
        return into
    if isinstance(saved, tuple) and isinstance(into, tuple) and len(saved) == len(into):
        return tuple(apply_into(v, lv, values, _path_join(path, i), load) for i, (v, lv) in enumerate(zip(saved, into)))
    return fill_tree(saved, values)
