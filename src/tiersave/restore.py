"""Restore one checkpoint into a live state: choose destinations, read and verify, copy, rebuild.

Scope: deciding, for each stored tensor, whether its bytes can land directly in a live tensor's memory
(same dtype and shape, CPU, contiguous, not already claimed by another stored tensor), allocating the
rest (pinned when a CUDA copy follows), reading everything with checksum verification, then copying to
the live tensors that could not be read in place and loading the tree into the live state.
Nothing in the live state changes through ``load_state_dict`` or dict updates unless every byte verified.
"""

from __future__ import annotations

import bisect
from concurrent.futures import Executor
from typing import Any

import numpy as np
import torch

from .catalog import OpenCheckpoint
from .engine.reader import ReadRequest
from .errors import StateMismatchError
from .format.layout import ALIGN
from .state import (
    apply_into,
    as_bits,
    decode_placeholders,
    fill_tree,
    fits,
    match_targets,
    ndarray_byte_view,
    readable_in_place,
    tensor_byte_view,
    torch_dtype,
)


class Restore:
    """One restore of one checkpoint: choose destinations, read, copy, rebuild."""

    def __init__(self, ckpt: OpenCheckpoint, into: Any, strict: bool) -> None:
        self.ckpt = ckpt
        self.into = into
        self.strict = strict

    def run(self, pool: Executor) -> tuple[Any, int, int]:
        manifest = self.ckpt.manifest
        saved = decode_placeholders(manifest.tree)
        targets = match_targets(saved, self.into, strict=self.strict) if self.into is not None else {}
        requests: list[ReadRequest] = []
        dests: dict[str, torch.Tensor | np.ndarray] = {}
        claimed = _Intervals()
        in_place = 0
        for name, entry in manifest.tensors.items():
            candidates = targets.get(name, [])
            for t in candidates:
                if t.strict and not fits(t.value, entry.dtype, entry.shape):
                    raise StateMismatchError(
                        f"{t.path}: the live value is {_describe(t.value)} but step {manifest.step} holds "
                        f"{entry.dtype}{list(entry.shape)}"
                    )
            dest: torch.Tensor | np.ndarray | None = None
            for t in candidates:
                if fits(t.value, entry.dtype, entry.shape) and readable_in_place(t.value):
                    span = _span(t.value)
                    if span[1] > span[0] and claimed.overlaps(*span):
                        continue  # memory already filled by another stored tensor (tied in the live model)
                    claimed.add(*span)
                    dest = t.value
                    in_place += 1
                    break
            if dest is None:
                pin = any(isinstance(t.value, torch.Tensor) and t.value.device.type == "cuda" for t in candidates)
                dest = new_tensor(entry.shape, torch_dtype(entry.dtype), entry.nbytes, pin=pin)
            dests[name] = dest
            view = ndarray_byte_view(dest) if isinstance(dest, np.ndarray) else tensor_byte_view(dest)
            requests.append(ReadRequest(entry, view))
        self.ckpt.read(requests, executor=pool)
        values: dict[str, Any] = {}
        for name, entry in manifest.tensors.items():
            dest = dests[name]
            primary: Any = dest
            for t in targets.get(name, []):
                if t.value is dest or not fits(t.value, entry.dtype, entry.shape):
                    continue
                _copy_into(t.value, dest)
                if primary is dest:
                    primary = t.value
            values[name] = primary
        if any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in values.values()):
            torch.cuda.synchronize()
        result = fill_tree(saved, values) if self.into is None else apply_into(saved, self.into, values)
        return result, manifest.total_bytes, in_place


class _Intervals:
    """Disjoint half-open byte ranges, with an O(log n) overlap test (a state has thousands of tensors)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._starts, start)
        if i > 0 and self._ends[i - 1] > start:
            return True
        return i < len(self._starts) and self._starts[i] < end

    def add(self, start: int, end: int) -> None:
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._ends.insert(i, end)


_ALIGNED_MIN = 1 << 20


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """An uninitialized tensor to restore into; page-aligned when large, so direct I/O reads land in it
    with no bounce copy (torch's own allocations start a few bytes past a page boundary)."""
    if nbytes < _ALIGNED_MIN:
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start : start + nbytes].view(dtype).view(shape)


def _span(value: torch.Tensor | np.ndarray) -> tuple[int, int]:
    if isinstance(value, np.ndarray):
        start = int(value.__array_interface__["data"][0])
        return start, start + value.nbytes
    start = value.data_ptr()
    return start, start + value.numel() * value.element_size()


def _copy_into(target: torch.Tensor | np.ndarray, src: torch.Tensor | np.ndarray) -> None:
    if isinstance(target, np.ndarray):
        np.copyto(target, src.numpy() if isinstance(src, torch.Tensor) else src)
        return
    source = torch.from_numpy(src) if isinstance(src, np.ndarray) else src
    with torch.no_grad():
        as_bits(target).copy_(as_bits(source), non_blocking=target.device.type == "cuda")


def _describe(value: torch.Tensor | np.ndarray) -> str:
    if isinstance(value, np.ndarray):
        return f"numpy {value.dtype}{list(value.shape)}"
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)} on {value.device}"
