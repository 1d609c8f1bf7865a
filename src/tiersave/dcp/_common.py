"""Helpers shared by the DCP writer and reader: argument checks, raw tensor bytes, checksum chunks."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from ..errors import ConfigError
from ..format.layout import MAX_CHUNK_BYTES, MAX_STEP
from ..storage.base import Storage

MAX_THREADS = 64


def check_step(step: Any, *, optional: bool = False) -> int | None:
    """``step`` as an int in [0, 2**63), or None when ``optional``; ConfigError otherwise."""
    if step is None and optional:
        return None
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ConfigError(f"step must be an integer in [0, 2**63){' or None' if optional else ''}, got {step!r}")
    return step


def check_threads(threads: Any) -> int:
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS:
        raise ConfigError(f"threads must be an integer in [1, {MAX_THREADS}], got {threads!r}")
    return threads


def check_chunk_bytes(chunk_bytes: Any) -> int:
    if (
        not isinstance(chunk_bytes, int)
        or isinstance(chunk_bytes, bool)
        or not 4096 <= chunk_bytes <= MAX_CHUNK_BYTES
        or chunk_bytes % 4096
    ):
        raise ConfigError(f"chunk_bytes must be a multiple of 4096 in [4096, {MAX_CHUNK_BYTES}], got {chunk_bytes!r}")
    return chunk_bytes


def root_text(root: str | os.PathLike[str] | Storage) -> str:
    if isinstance(root, Storage):
        return root.uri
    if not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"root must be a path, a storage URI or a Storage, got {type(root).__name__}")
    return os.fspath(root)


def check_checkpoint_id(checkpoint_id: str | os.PathLike[str] | None, root: str, storage: Storage, cls: str) -> None:
    """DCP passes ``checkpoint_id`` to ``reset``; tiersave takes the location from the constructor."""
    if checkpoint_id is None:
        return
    text = os.fspath(checkpoint_id)
    if text in (root, storage.uri):
        return
    raise ConfigError(
        f"tiersave.dcp.{cls} got checkpoint_id={text!r} but was made for {root!r}: the root and the step "
        f"are given to {cls}(root, step=...); call dcp with checkpoint_id=None"
    )


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16 and float8 included).

    The caller keeps ``tensor`` alive while the view is in use.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buf = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    return memoryview(buf).cast("B")


def aligned_empty(nbytes: int, align: int = 4096) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose first byte sits at a multiple of ``align`` (for direct I/O)."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % align
    return raw[skip : skip + nbytes]
