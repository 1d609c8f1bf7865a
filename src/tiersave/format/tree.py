"""The JSON encoding of the state tree (docs/format.md section 5).

Encoding of torch and numpy objects lives in ``tiersave.state``; this module holds the grammar shared by
every reader: the tag names, key escaping, non-finite floats, and one decoder that walks a tree and hands
leaves (tensors, arrays, stateful objects) to caller-supplied hooks. Validation, restore and ``inspect``
all use this one decoder, so they cannot disagree about what a tree means.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Iterable
from typing import Any, Protocol

from ..errors import FormatError
from .dtypes import lookup

T_FLOAT = "$float"
T_DICT = "$dict"
T_TUPLE = "$tuple"
T_BYTES = "$bytes"
T_TENSOR = "$tensor"
T_NDARRAY = "$ndarray"
T_NPSCALAR = "$npscalar"
T_DTYPE = "$dtype"
T_STATEFUL = "$stateful"
T_STATEDICT = "$statedict"
TAGS = frozenset({T_FLOAT, T_DICT, T_TUPLE, T_BYTES, T_TENSOR, T_NDARRAY, T_NPSCALAR, T_DTYPE, T_STATEFUL, T_STATEDICT})

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def escape_key(key: str) -> str:
    """Escape a user dict key so it can never be read as a tag: ``$x`` -> ``$$x``."""
    return "$" + key if key.startswith("$") else key


def unescape_key(key: str) -> str:
    return key[1:] if key.startswith("$") else key


def encode_float(value: float) -> Any:
    """A float as JSON: the number itself when finite, else a ``$float`` tag."""
    if math.isfinite(value):
        return value
    return {T_FLOAT: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}


def encode_bytes(value: bytes) -> Any:
    return {T_BYTES: base64.b64encode(value).decode("ascii")}


def is_tag(node: dict[str, Any]) -> bool:
    """True for a one-key object whose key starts with exactly one ``$``."""
    if len(node) != 1:
        return False
    (key,) = node
    return key.startswith("$") and not key.startswith("$$")


class TreeHooks(Protocol):
    """Builds the leaves of a decoded tree. Each method may raise :class:`FormatError`."""

    def tensor(self, name: str, path: str) -> Any: ...

    def ndarray(self, name: str, path: str) -> Any: ...

    def npscalar(self, dtype: str, raw: bytes, path: str) -> Any: ...

    def dtype(self, name: str, path: str) -> Any: ...

    def stateful(self, type_name: str, state: Any, path: str) -> Any: ...

    def statedict(self, entries: dict[Any, Any], metadata: Any, path: str) -> Any: ...


def _fail(path: str, message: str) -> FormatError:
    return FormatError(f"manifest tree at {path}: {message}", path=path)


def _check_key(key: Any, path: str) -> None:
    if isinstance(key, tuple):
        for item in key:
            _check_key(item, path)
    elif not (key is None or isinstance(key, (bool, int, float, str))):
        raise _fail(path, f"dict key of type {type(key).__name__} is not allowed")


MAX_TREE_DEPTH = 128
"""Deepest nesting of a state tree (containers, stateful objects and tags). Writers refuse deeper states and
readers reject deeper trees, with a typed error: the recursive encoders and decoders stay far inside
Python's recursion limit (about 3 frames a level), so no depth below this cap can raise RecursionError."""


class TreeDecoder:
    """Walks an encoded tree and rebuilds Python values, delegating leaves to ``hooks``."""

    def __init__(self, hooks: TreeHooks) -> None:
        self._hooks = hooks

    def decode(self, node: Any, path: str = "", depth: int = 0) -> Any:
        if depth > MAX_TREE_DEPTH:
            raise _fail(path or "<root>", f"nested deeper than {MAX_TREE_DEPTH} levels")
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if isinstance(node, float):
            if not math.isfinite(node):  # cannot come from strict JSON, but trees may be built in memory
                raise _fail(path or "<root>", "non-finite float must use the $float tag")
            return node
        if isinstance(node, list):
            return [self.decode(v, f"{path}.{i}" if path else str(i), depth + 1) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            raise _fail(path or "<root>", f"unexpected JSON value of type {type(node).__name__}")
        if is_tag(node):
            ((tag, payload),) = node.items()
            return self._decode_tag(tag, payload, path or "<root>", depth)
        out: dict[Any, Any] = {}
        leaf_ok = depth < MAX_TREE_DEPTH
        for key, value in node.items():
            plain = unescape_key(key)
            child = f"{path}.{plain}" if path else plain
            # A tensor leaf, by far the commonest node (10^5 in a large model), straight to its hook: what
            # decode() and _decode_tag() would do with it, without their two calls and chain of tests.
            if leaf_ok and type(value) is dict and len(value) == 1 and type(value.get(T_TENSOR)) is str:
                out[plain] = self._hooks.tensor(value[T_TENSOR], child or "<root>")
            else:
                out[plain] = self.decode(value, child, depth + 1)
        return out

    def _decode_tag(self, tag: str, payload: Any, path: str, depth: int) -> Any:
        hooks = self._hooks
        if tag == T_FLOAT:
            if not isinstance(payload, str) or payload not in _NONFINITE:
                raise _fail(path, f"bad $float value {payload!r}")
            return _NONFINITE[payload]
        if tag == T_TUPLE:
            if not isinstance(payload, list):
                raise _fail(path, "$tuple needs an array")
            return tuple(self.decode(v, f"{path}.{i}", depth + 1) for i, v in enumerate(payload))
        if tag == T_DICT:
            if not isinstance(payload, list):
                raise _fail(path, "$dict needs an array of [key, value] pairs")
            out: dict[Any, Any] = {}
            for i, pair in enumerate(payload):
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise _fail(f"{path}[{i}]", "$dict entries must be [key, value] pairs")
                key = pair[0]
                if type(key) is not int and type(key) is not str:  # an optimizer's state has 10^5 int keys
                    key = self.decode(key, f"{path}[{i}].key", depth + 1)
                    _check_key(key, f"{path}[{i}].key")
                if key in out:
                    raise _fail(f"{path}[{i}]", f"duplicate dict key {key!r}")
                out[key] = self.decode(pair[1], f"{path}.{key}", depth + 1)
            return out
        if tag == T_BYTES:
            if not isinstance(payload, str):
                raise _fail(path, "$bytes needs a base64 string")
            try:
                return base64.b64decode(payload.encode("ascii"), validate=True)
            except (binascii.Error, UnicodeEncodeError):
                raise _fail(path, "$bytes is not valid base64") from None
        if tag in (T_TENSOR, T_NDARRAY):
            if not isinstance(payload, str):
                raise _fail(path, f"{tag} needs a tensor name")
            return hooks.tensor(payload, path) if tag == T_TENSOR else hooks.ndarray(payload, path)
        if tag == T_DTYPE:
            if not isinstance(payload, str) or lookup(payload) is None:
                raise _fail(path, f"unknown dtype {payload!r}")
            return hooks.dtype(payload, path)
        if tag == T_NPSCALAR:
            if not (isinstance(payload, dict) and set(payload) == {"dtype", "hex"}):
                raise _fail(path, "$npscalar needs exactly 'dtype' and 'hex'")
            dtype, hexstr = payload["dtype"], payload["hex"]
            info = lookup(dtype) if isinstance(dtype, str) else None
            if info is None or info.numpy is None:
                raise _fail(path, f"$npscalar has unsupported dtype {dtype!r}")
            try:
                raw = bytes.fromhex(hexstr) if isinstance(hexstr, str) else None
            except ValueError:
                raw = None
            if raw is None or len(raw) != info.itemsize:
                raise _fail(path, f"$npscalar needs {info.itemsize} bytes of hex for {dtype}")
            return hooks.npscalar(dtype, raw, path)
        if tag == T_STATEFUL:
            if not (isinstance(payload, dict) and set(payload) == {"type", "state"}):
                raise _fail(path, "$stateful needs exactly 'type' and 'state'")
            type_name = payload["type"]
            if not isinstance(type_name, str) or len(type_name) > 256:
                raise _fail(path, "$stateful type must be a short string")
            state = self.decode(payload["state"], path, depth + 1)
            return hooks.stateful(type_name, state, path)
        if tag == T_STATEDICT:
            if not (isinstance(payload, dict) and set(payload) == {"entries", "metadata"}):
                raise _fail(path, "$statedict needs exactly 'entries' and 'metadata'")
            entries = self.decode(payload["entries"], path, depth + 1)
            if not isinstance(entries, dict):
                raise _fail(path, "$statedict entries must be a dict")
            metadata = self.decode(payload["metadata"], f"{path}._metadata", depth + 1)
            return hooks.statedict(entries, metadata, path)
        raise _fail(path, f"unknown tag {tag!r}")


class _ValidatingHooks:
    """Hooks that build nothing and record which tensors the tree references."""

    def __init__(self, names: set[str]) -> None:
        self._names = names
        self.referenced: set[str] = set()

    def _ref(self, name: str, path: str) -> None:
        if name not in self._names:
            raise _fail(path, f"references unknown tensor {name!r}")
        self.referenced.add(name)

    def tensor(self, name: str, path: str) -> Any:
        self._ref(name, path)
        return None

    def ndarray(self, name: str, path: str) -> Any:
        self._ref(name, path)
        return None

    def npscalar(self, dtype: str, raw: bytes, path: str) -> Any:
        return None

    def dtype(self, name: str, path: str) -> Any:
        return None

    def stateful(self, type_name: str, state: Any, path: str) -> Any:
        return None

    def statedict(self, entries: dict[Any, Any], metadata: Any, path: str) -> Any:
        return None


def validate_tree(tree: Any, tensor_names: set[str], referenced: Iterable[str] = (), depth: int = 0) -> None:
    """Check the tree's grammar, that it references only known tensors, and that it references all of them.
    ``referenced``: known tensors referenced by parts of the tree the caller checked (the runs of format 4.x);
    ``depth``: the level ``tree`` lies at in its whole tree (1 for a rank's subtree)."""
    hooks = _ValidatingHooks(tensor_names)
    hooks.referenced.update(referenced)
    TreeDecoder(hooks).decode(tree, depth=depth)
    orphans = tensor_names - hooks.referenced
    if orphans:
        sample = ", ".join(sorted(orphans)[:3])
        raise FormatError(f"manifest lists {len(orphans)} tensor(s) the tree never uses: {sample}")
