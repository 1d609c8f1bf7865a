"""Export a checkpoint's tensors to a safetensors file (for inference servers and other tools).

Torch-free: bytes are read (and verified against their checksums) straight from the shards and written
in the safetensors layout: an 8-byte little-endian header length, a JSON header, then the tensors packed
back to back. The file is written to a temporary name, fsynced and renamed, so a reader never sees a
partial export.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import knobs
from .catalog import Catalog
from .engine.reader import ReadRequest
from .errors import ConfigError, storage_error_from_os
from .format.dtypes import lookup
from .format.layout import new_token

_BATCH_BYTES = 256 << 20


@dataclass
class ExportResult:
    path: str
    step: int
    tensors: int
    bytes: int
    skipped: list[str]


def export_safetensors(
    catalog: Catalog,
    step: int,
    dest: str | os.PathLike[str],
    *,
    prefix: str = "",
    skip_unsupported: bool = False,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Write the tensors of ``step`` whose names start with ``prefix`` to ``dest`` as safetensors.

    Args:
        prefix: select tensors by name prefix and strip it (``"model."`` exports a model's weights
            under the names ``model.state_dict()`` uses).
        skip_unsupported: leave out tensors whose dtype safetensors cannot represent instead of failing.
        overwrite: replace an existing ``dest``.
        progress: called with ``(bytes_written, bytes_total)`` after each batch of reads (at most 256 MiB).

    Raises:
        ConfigError: nothing selected, an unsupported dtype, or ``dest`` exists.
    """
    path = Path(dest)
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists; pass overwrite=True (--force) to replace it")
    manifest = catalog.manifest(step)
    selected, skipped = [], []
    for entry in manifest.tensors.values():
        if not entry.name.startswith(prefix):
            continue
        st_name = lookup(entry.dtype).safetensors  # type: ignore[union-attr]
        if st_name is None:
            if not skip_unsupported:
                raise ConfigError(
                    f"tensor {entry.name!r} has dtype {entry.dtype}, which safetensors cannot store "
                    "(use --skip-unsupported to leave it out)"
                )
            skipped.append(entry.name)
            continue
        selected.append((entry.name[len(prefix) :] or entry.name, st_name, entry))
    if not selected:
        raise ConfigError(f"no tensors of step {step} match prefix {prefix!r}")
    header: dict[str, object] = {"__metadata__": {"format": "pt", "tiersave_step": str(step)}}
    cursor = 0
    for name, st_name, entry in selected:
        header[name] = {
            "dtype": st_name,
            "shape": list(entry.shape),
            "data_offsets": [cursor, cursor + entry.nbytes],
        }
        cursor += entry.nbytes
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # safetensors pads the header to 8 bytes with spaces
    tmp = path.with_name(f".{path.name}.tmp-{new_token()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        raise storage_error_from_os(exc, tier=str(path.parent), key=tmp.name, action="creating") from None
    try:
        with (
            os.fdopen(fd, "wb") as f,
            ThreadPoolExecutor(knobs.io_threads()) as pool,
            catalog.open(step) as ckpt,
        ):
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            batch: list[ReadRequest] = []
            buffers: list[bytearray] = []

            pending = [0, 0]  # bytes in this batch, bytes written

            def flush() -> None:
                ckpt.read(batch, executor=pool)
                for buf in buffers:
                    f.write(buf)
                batch.clear()
                buffers.clear()
                pending[1] += pending[0]
                pending[0] = 0
                if progress is not None:
                    progress(pending[1], cursor)

            for _, _, entry in selected:
                buf = bytearray(entry.nbytes)
                buffers.append(buf)
                batch.append(ReadRequest(entry, memoryview(buf)))
                pending[0] += entry.nbytes
                if pending[0] >= _BATCH_BYTES:
                    flush()
            flush()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ExportResult(str(path), step, len(selected), cursor, skipped)
