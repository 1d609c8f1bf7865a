"""DCP ``Metadata`` <-> the manifest's JSON tree, without pickle.

Scope: turning the ``Metadata`` object that ``torch.distributed.checkpoint`` hands a storage writer into
plain JSON for the manifest's ``tree`` (docs/dcp.md, "What is stored"), and turning such a tree back into
``Metadata`` with every value checked first: dtypes from the closed set, sizes and offsets in range,
chunks inside their tensor and covering it, every chunk's stored tensor of the right dtype and shape.
A tree that fails any check raises :class:`~tiersave.errors.FormatError` naming the step and the key.
Anti-scope: I/O, checksums (the manifest parser and the reader do those), DCP planning.

DCP's own ``FileSystemWriter`` pickles ``Metadata``; here nothing is pickled and nothing names a class.
The tree, under the manifest's ``tree["dcp"]``::

    {"encoding": "tiersave.dcp/1", "version": "1.0.0",
     "state": {FQN: {"kind": "tensor", "dtype": "float32", "size": [...], "requires_grad": false,
                     "memory_format": "contiguous", "pin_memory": false,
                     "chunks": [{"offsets": [...], "sizes": [...], "data": {"$tensor": NAME}}]}
               FQN: {"kind": "bytes", "data": {"$tensor": NAME}}},
     "planner_data": null | {FQN: [key or index, ...]},
     "storage_meta": null | {"checkpoint_id": str|null, "save_id": str|null, "modules": [str]}}

FQN keys are escaped like every dict key of a tree (a leading ``$`` is doubled). ``NAME`` is a tensor of
the manifest: its entry gives the shard, offset, length and per-chunk CRC-32C of the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import FormatError, UnsupportedStateError
from ..format.dtypes import lookup
from ..format.manifest import Manifest, TensorEntry
from ..format.tree import T_TENSOR, escape_key, unescape_key

ENCODING = "tiersave.dcp/1"
TREE_KEY = "dcp"
DEFAULT_DCP_VERSION = "1.0.0"

_MAX_INT = (1 << 63) - 1
_MAX_NDIM = 64
_MAX_TEXT = 4096
_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve": torch.preserve_format,
}
_TOP_FIELDS = frozenset({"encoding", "version", "state", "planner_data", "storage_meta"})
_TENSOR_FIELDS = frozenset({"kind", "dtype", "size", "requires_grad", "memory_format", "pin_memory", "chunks"})
_BYTES_FIELDS = frozenset({"kind", "data"})
_CHUNK_FIELDS = frozenset({"offsets", "sizes", "data"})
_META_FIELDS = frozenset({"checkpoint_id", "save_id", "modules"})


def dtype_name(dtype: torch.dtype) -> str | None:
    """The format's name for a torch dtype (``torch.float32`` -> ``"float32"``), or None if it has none."""
    name = str(dtype).removeprefix("torch.")
    return name if lookup(name) is not None else None


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of a format dtype name, or None when this torch build lacks it."""
    if lookup(name) is None:
        return None
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


def chunk_name(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], whole: bool) -> str:
    """The manifest tensor name of one stored chunk: the FQN for a whole tensor, else FQN[a:b,c:d]."""
    if whole:
        return fqn
    return f"{fqn}[{','.join(f'{o}:{o + s}' for o, s in zip(offsets, sizes, strict=True))}]"


@dataclass(frozen=True, slots=True)
class Location:
    """Where the bytes of one stored DCP item live.

    Attributes:
        entry: the manifest tensor entry (shard, offset, length, checksums).
        dtype: the torch dtype of the stored chunk (uint8 for pickled items).
        sizes: the stored chunk's shape.
    """

    entry: TensorEntry
    dtype: torch.dtype
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Decoded:
    """A DCP checkpoint read back from a manifest: DCP's ``Metadata`` and where each item's bytes are."""

    metadata: Metadata
    locations: Mapping[MetadataIndex, Location]


# -- encoding (coordinator, at finish) ------------------------------------------------------------------


def encode(
    metadata: Metadata,
    names: Mapping[MetadataIndex, str],
) -> dict[str, Any]:
    """Encode ``metadata`` as the tree stored under ``tree["dcp"]``.

    Args:
        metadata: the global metadata DCP passes to ``StorageWriter.finish``.
        names: the manifest tensor name of every written item, by its index (``offset`` None for bytes).

    Raises:
        UnsupportedStateError: a value that plain JSON cannot hold without pickle (a custom planner's
            ``planner_data``, a sparse layout, a dtype outside the format's set); ``path`` names it.
    """
    state: dict[str, Any] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            state[escape_key(fqn)] = {"kind": "bytes", "data": {T_TENSOR: names[MetadataIndex(fqn)]}}
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise UnsupportedStateError(f"DCP item {fqn!r} is a {type(item).__name__}", path=fqn)
        props = item.properties
        name = dtype_name(props.dtype)
        if name is None:
            raise UnsupportedStateError(f"tensor {fqn!r} has dtype {props.dtype}, not storable", path=fqn)
        if props.layout != torch.strided:
            raise UnsupportedStateError(f"tensor {fqn!r} has layout {props.layout}; only strided", path=fqn)
        memory_format = next((k for k, v in _MEMORY_FORMATS.items() if v == props.memory_format), None)
        if memory_format is None:
            raise UnsupportedStateError(f"tensor {fqn!r} has memory format {props.memory_format}", path=fqn)
        chunks = []
        for chunk in item.chunks:
            index = MetadataIndex(fqn, chunk.offsets)
            chunks.append(
                {"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "data": {T_TENSOR: names[index]}}
            )
        state[escape_key(fqn)] = {
            "kind": "tensor",
            "dtype": name,
            "size": list(item.size),
            "requires_grad": bool(props.requires_grad),
            "memory_format": memory_format,
            "pin_memory": bool(props.pin_memory),
            "chunks": chunks,
        }
    return {
        "encoding": ENCODING,
        "version": metadata.version or DEFAULT_DCP_VERSION,
        "state": state,
        "planner_data": _encode_planner_data(metadata.planner_data),
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
    }


def _encode_planner_data(value: Any) -> Any:
    if value is None:
        return None
    # DefaultSavePlanner: {flattened fqn: (key or index, ...)}, the path back into the nested state dict.
    if not isinstance(value, dict):
        raise UnsupportedStateError(
            f"planner_data of type {type(value).__name__} cannot be stored without pickle; tiersave.dcp "
            "supports DefaultSavePlanner (and planners that keep its {fqn: path} planner_data)",
            path="planner_data",
        )
    out: dict[str, Any] = {}
    for fqn, path in value.items():
        ok = isinstance(fqn, str) and isinstance(path, (tuple, list))
        if ok:
            ok = all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in path)
        if not ok:
            raise UnsupportedStateError(
                f"planner_data entry {fqn!r}: {path!r} is not a path of str keys and int indices", path=str(fqn)
            )
        out[escape_key(fqn)] = list(path)
    return out


def _encode_storage_meta(meta: StorageMeta | None) -> Any:
    if meta is None:
        return None
    cid = meta.checkpoint_id
    return {
        "checkpoint_id": None if cid is None else str(cid),
        "save_id": meta.save_id,
        "modules": [str(m) for m in meta.modules],
    }


# -- decoding (every rank, at load) ---------------------------------------------------------------------


class _Check:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, message: str) -> FormatError:
        return FormatError(f"{self.where}: DCP metadata {message}", path=self.where)

    def obj(self, value: Any, fields: frozenset[str], what: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} must be an object")
        if value.keys() != fields:
            missing, unknown = fields - value.keys(), value.keys() - fields
            raise self.fail(f"{what}: missing {sorted(missing)}, unknown {sorted(unknown)}")
        return value

    def integer(self, value: Any, what: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_INT:
            raise self.fail(f"{what} must be an integer in [0, 2**63), got {value!r}")
        return value

    def dims(self, value: Any, what: str) -> tuple[int, ...]:
        if not isinstance(value, list) or len(value) > _MAX_NDIM:
            raise self.fail(f"{what} must be an array of at most {_MAX_NDIM} integers")
        return tuple(self.integer(v, f"{what}[{i}]") for i, v in enumerate(value))

    def boolean(self, value: Any, what: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(f"{what} must be true or false")
        return value

    def text(self, value: Any, what: str, *, optional: bool = False) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or len(value) > _MAX_TEXT:
            raise self.fail(f"{what} must be a string of at most {_MAX_TEXT} characters")
        return value

    def data(self, value: Any, manifest: Manifest, what: str) -> TensorEntry:
        if not isinstance(value, dict) or value.keys() != {T_TENSOR} or not isinstance(value[T_TENSOR], str):
            raise self.fail(f"{what}.data must be {{'{T_TENSOR}': name}}")
        entry = manifest.tensors.get(value[T_TENSOR])
        if entry is None:
            raise self.fail(f"{what}.data names tensor {value[T_TENSOR]!r}, which the manifest lacks")
        return entry


def is_dcp(manifest: Manifest) -> bool:
    """True when ``manifest`` was written by :class:`tiersave.dcp.Writer` (judged by its tree's marker)."""
    tree = manifest.tree
    return (
        isinstance(tree, dict)
        and isinstance(tree.get(TREE_KEY), dict)
        and tree[TREE_KEY].get("encoding") == ENCODING
        and tree.keys() == {TREE_KEY}
    )


def decode(manifest: Manifest, *, where: str) -> Decoded:
    """Rebuild DCP ``Metadata`` from a parsed, validated manifest, checking every value first.

    Args:
        manifest: the checkpoint's manifest (already validated by ``Manifest.parse``).
        where: the checkpoint's location, for messages.

    Raises:
        FormatError: not a DCP checkpoint, or any value out of place (the message names the key).
    """
    check = _Check(where)
    tree = manifest.tree
    if not is_dcp(manifest):
        raise FormatError(
            f"{where} is not a DCP checkpoint (its tree lacks the {ENCODING!r} marker); it was saved "
            "with tiersave.Checkpointer: restore it with Checkpointer.restore, not dcp.load",
            path=where,
        )
    doc = check.obj(tree[TREE_KEY], _TOP_FIELDS, "top level")
    version = check.text(doc["version"], "version")
    if not isinstance(doc["state"], dict):
        raise check.fail("state must be an object")
    state_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    locations: dict[MetadataIndex, Location] = {}
    for key, raw in doc["state"].items():
        fqn = unescape_key(key)
        what = f"state[{fqn!r}]"
        kind = raw.get("kind") if isinstance(raw, dict) else None
        if kind == "bytes":
            item = check.obj(raw, _BYTES_FIELDS, what)
            entry = check.data(item["data"], manifest, what)
            if entry.dtype != "uint8" or len(entry.shape) != 1:
                got = f"{entry.dtype}{list(entry.shape)}"
                raise check.fail(f"{what}: pickled bytes must be a 1-d uint8 tensor, got {got}")
            state_md[fqn] = BytesStorageMetadata()
            locations[MetadataIndex(fqn)] = Location(entry, torch.uint8, entry.shape)
        elif kind == "tensor":
            state_md[fqn] = _decode_tensor(check, manifest, fqn, check.obj(raw, _TENSOR_FIELDS, what), locations)
        else:
            raise check.fail(f"{what}.kind must be 'tensor' or 'bytes'")
    return Decoded(
        Metadata(
            state_dict_metadata=state_md,
            planner_data=_decode_planner_data(check, doc["planner_data"]),
            storage_data=None,
            storage_meta=_decode_storage_meta(check, doc["storage_meta"]),
            version=version,
        ),
        locations,
    )


def _decode_tensor(
    check: _Check, manifest: Manifest, fqn: str, raw: dict[str, Any], locations: dict[MetadataIndex, Location]
) -> TensorStorageMetadata:
    what = f"state[{fqn!r}]"
    name = raw["dtype"]
    dtype = torch_dtype(name) if isinstance(name, str) else None
    if dtype is None:
        raise check.fail(f"{what}.dtype {name!r} is not a dtype of the format known to this torch")
    size = check.dims(raw["size"], f"{what}.size")
    memory_format = _MEMORY_FORMATS.get(raw["memory_format"]) if isinstance(raw["memory_format"], str) else None
    if memory_format is None:
        raise check.fail(f"{what}.memory_format must be one of {sorted(_MEMORY_FORMATS)}")
    props = TensorProperties(
        dtype=dtype,
        layout=torch.strided,
        requires_grad=check.boolean(raw["requires_grad"], f"{what}.requires_grad"),
        memory_format=memory_format,
        pin_memory=check.boolean(raw["pin_memory"], f"{what}.pin_memory"),
    )
    if not isinstance(raw["chunks"], list):
        raise check.fail(f"{what}.chunks must be an array")
    chunks = []
    covered = 0
    for i, craw in enumerate(raw["chunks"]):
        cwhat = f"{what}.chunks[{i}]"
        c = check.obj(craw, _CHUNK_FIELDS, cwhat)
        offsets = check.dims(c["offsets"], f"{cwhat}.offsets")
        sizes = check.dims(c["sizes"], f"{cwhat}.sizes")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise check.fail(f"{cwhat} has {len(offsets)}/{len(sizes)} dimensions; the tensor has {len(size)}")
        for d, (o, s, n) in enumerate(zip(offsets, sizes, size, strict=True)):
            if o + s > n:
                raise check.fail(f"{cwhat} spans [{o}, {o + s}) of dimension {d}, which has {n}")
        entry = check.data(c["data"], manifest, cwhat)
        if entry.dtype != name or entry.shape != sizes:
            raise check.fail(f"{cwhat} is stored as {entry.dtype}{list(entry.shape)}, expected {name}{list(sizes)}")
        index = MetadataIndex(fqn, offsets)
        if index in locations:
            raise check.fail(f"{cwhat}: two chunks start at offsets {list(offsets)}")
        locations[index] = Location(entry, dtype, sizes)
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        covered += math.prod(sizes)
    # Chunks start at distinct offsets and lie inside the tensor; equal volume means none is missing (a
    # missing chunk would leave part of the destination silently unloaded).
    if covered != math.prod(size):
        raise check.fail(f"{what}: its chunks hold {covered} elements, the tensor has {math.prod(size)}")
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _decode_planner_data(check: _Check, raw: Any) -> Any:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise check.fail("planner_data must be null or an object")
    out: dict[str, tuple[str | int, ...]] = {}
    for key, path in raw.items():
        if not isinstance(path, list) or len(path) > 512:
            raise check.fail(f"planner_data[{key!r}] must be an array")
        parts: list[str | int] = []
        for p in path:
            if isinstance(p, str) and len(p) <= _MAX_TEXT:
                parts.append(p)
            else:
                parts.append(check.integer(p, f"planner_data[{key!r}] element"))
        out[unescape_key(key)] = tuple(parts)
    return out


def _decode_storage_meta(check: _Check, raw: Any) -> StorageMeta | None:
    if raw is None:
        return None
    meta = check.obj(raw, _META_FIELDS, "storage_meta")
    modules = meta["modules"]
    if not isinstance(modules, list) or len(modules) > 65536:
        raise check.fail("storage_meta.modules must be an array of strings")
    return StorageMeta(
        checkpoint_id=check.text(meta["checkpoint_id"], "storage_meta.checkpoint_id", optional=True),
        save_id=check.text(meta["save_id"], "storage_meta.save_id", optional=True),
        modules=[str(check.text(m, "storage_meta.modules[]")) for m in modules],
    )
