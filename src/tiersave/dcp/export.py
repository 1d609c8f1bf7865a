"""Consolidate a DCP checkpoint's sharded tensors into one safetensors file.

Scope: for a checkpoint written by :class:`tiersave.dcp.Writer` (on any number of ranks), assemble every
tensor from its chunks (each chunk's checksums verified) and write the whole tensors under their state
dict names to a safetensors file: what users otherwise script by hand for Hugging Face. One tensor is
held in memory at a time. Pickled (non-tensor) items are left out and listed in the result.
Anti-scope: the CLI (``tiersave export`` would call :func:`export_safetensors` for DCP checkpoints),
non-DCP checkpoints (``tiersave.export`` handles those), resharding onto ranks (``dcp.load``).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from ..errors import ConfigError, storage_error_from_os
from ..format.dtypes import lookup
from ..format.layout import new_token
from ..storage.base import Storage
from . import metadata as dcpmeta
from ._common import byte_view
from .reader import Reader, _Load


@dataclass
class ExportSummary:
    """What :func:`export_safetensors` wrote.

    Attributes:
        path: the safetensors file.
        step: the checkpoint's step.
        tensors: number of tensors written.
        bytes: tensor bytes written.
        pickled: names of the non-tensor items left out.
        skipped: names of tensors left out because safetensors has no such dtype (``skip_unsupported``).
    """

    path: str
    step: int
    tensors: int
    bytes: int
    pickled: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def export_safetensors(
    root: str | os.PathLike[str] | Storage,
    dest: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str = "",
    skip_unsupported: bool = False,
    overwrite: bool = False,
) -> ExportSummary:
    """Write the whole tensors of a DCP checkpoint to ``dest`` as one safetensors file.

    Args:
        root: the checkpoint root (a path or URI, as for :class:`~tiersave.dcp.Reader`).
        dest: the file to write (a temporary name is fsynced and renamed into place).
        step: the step; None for the newest.
        prefix: export only the tensors whose names start with it, and strip it (``"model."`` gives the
            names ``model.state_dict()`` uses).
        skip_unsupported: leave out tensors whose dtype safetensors lacks instead of failing.
        overwrite: replace an existing ``dest``.

    Raises:
        ConfigError: ``dest`` exists, nothing matches ``prefix``, or an unsupported dtype.
        CorruptCheckpointError: a chunk's bytes do not match their checksum.
    """
    path = Path(dest)
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists; pass overwrite=True to replace it")
    reader = Reader(root, step=step)
    md = reader._decoded.metadata
    summary = ExportSummary(str(path), reader.step, 0, 0)
    selected: list[tuple[str, str, TensorStorageMetadata]] = []
    for fqn, item in md.state_dict_metadata.items():
        if not fqn.startswith(prefix):
            continue
        if isinstance(item, BytesStorageMetadata):
            summary.pickled.append(fqn)
            continue
        assert isinstance(item, TensorStorageMetadata)
        name = dcpmeta.dtype_name(item.properties.dtype)
        info = lookup(name) if name is not None else None
        st = info.safetensors if info is not None else None
        if st is None:
            if skip_unsupported:
                summary.skipped.append(fqn)
                continue
            raise ConfigError(f"{fqn!r} has dtype {item.properties.dtype}, which safetensors cannot hold")
        selected.append((fqn, st, item))
    if not selected:
        raise ConfigError(f"{reader.checkpoint_id} has no tensor whose name starts with {prefix!r}")

    header: dict[str, object] = {"__metadata__": {"format": "pt", "tiersave.step": str(reader.step)}}
    pos = 0
    for fqn, st, item in selected:
        nbytes = item.properties.dtype.itemsize
        for s in item.size:
            nbytes *= s
        header[fqn[len(prefix) :]] = {"dtype": st, "shape": list(item.size), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors pads the header to a multiple of 8 bytes

    tmp = path.with_name(f".{path.name}.tmp-{new_token()}")
    loader = _Load(reader, None)
    try:
        with open(tmp, "xb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for fqn, _, item in selected:
                locs = [reader._decoded.locations[MetadataIndex(fqn, c.offsets)] for c in item.chunks]
                for loc in locs:  # the chunks' shards hold them (real lengths) before the tensor is allocated
                    loader._blob(loc.entry.shard)
                full = torch.empty(tuple(item.size), dtype=item.properties.dtype)
                for chunk, loc in zip(item.chunks, locs, strict=True):
                    part = loader.read_whole(loc)
                    region = full
                    for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                        region = region.narrow(dim, o, n)
                    region.copy_(part)
                f.write(byte_view(full))
                summary.tensors += 1
                summary.bytes += full.numel() * full.element_size()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise storage_error_from_os(exc, tier=str(path.parent), key=path.name, action="exporting to") from None
    finally:
        loader.close()
        if tmp.exists():
            tmp.unlink()
    return summary
