"""Restore a checkpoint: choose the step and the tier to read, then read one copy into a live state.

:func:`restore_from` picks the candidates (the requested step, or the newest), tries each copy fastest tier
first and falls back on a copy that is missing or fails verification (to another tier, then, for "newest",
to an older step). :class:`Restore` reads one copy: it decides, for each stored tensor, whether its bytes
can land directly in a live tensor's memory (same dtype and shape, CPU, contiguous, not already claimed by
another stored tensor), allocates the rest (pinned when a CUDA copy follows), reads everything with checksum
verification, then copies to the live tensors that could not be read in place and loads the tree into the
live state.
Nothing in the live state changes through ``load_state_dict`` or dict updates unless every byte verified.

Anti-scope: the byte reads and checksums (engine/reader.py), matching a saved tree against a live state
(state.py), which tiers exist and what they hold (tiers.py).
"""

from __future__ import annotations

import bisect
import time
import warnings
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .catalog import OpenCheckpoint
from .engine.reader import ReadRequest
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatError,
    StateMismatchError,
    StorageError,
    TiersaveError,
    TiersaveWarning,
)
from .format.jsonsafe import paused_gc
from .format.layout import ALIGN
from .state import (
    Target,
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
from .tiers import TierChain, TierRuntime


@dataclass
class RestoreReport:
    """What the last ``restore()`` did.

    Attributes:
        step: the step restored.
        location: URI of the checkpoint read.
        bytes_read: tensor bytes read and verified.
        seconds: wall time of the restore.
        in_place: tensors read directly into the live state's memory.
        skipped: ``(step, reason)`` for each copy (newer, or in a faster tier) that could not be used.
        tier: the name of the tier it was read from.
    """

    step: int
    location: str
    bytes_read: int
    seconds: float
    in_place: int
    skipped: list[tuple[int, str]] = field(default_factory=list)
    tier: str = ""


def restore_from(
    chain: TierChain, step: int | None, tag: str | None, into: Any, strict: bool, pool: Executor
) -> tuple[Any, RestoreReport]:
    """Restore ``step`` (None: the newest; with ``tag``, the newest carrying it) from the fastest tier holding
    a good copy; see ``Checkpointer.restore`` for the fallback rules and the errors raised."""
    start = time.perf_counter()
    holders: dict[int, list[TierRuntime]] = {}
    missing: list[CheckpointNotFoundError] = []
    for tier in chain.tiers:
        try:
            found = tier.catalog.find(step, tag)
        except CheckpointNotFoundError as exc:
            missing.append(exc)
            continue
        for s in found:
            holders.setdefault(s, []).append(tier)
    if not holders:
        if len(missing) == 1:
            raise missing[0]
        if missing:
            raise CheckpointNotFoundError("; ".join(str(e) for e in missing))
        raise CheckpointNotFoundError(f"no committed checkpoint in {chain.where()}")
    skipped: list[tuple[int, str]] = []
    last_error: TiersaveError | None = None
    for candidate in sorted(holders, reverse=True):
        for tier in holders[candidate]:
            chain.protection.hold(tier.index, candidate)  # retention must not delete what we are reading
            try:
                with tier.catalog.open(candidate) as ckpt:
                    result, nbytes, in_place = Restore(ckpt, into, strict).run(pool)
            except (FormatError, CheckpointNotFoundError, StorageError) as exc:  # this copy is unusable
                last_error = exc
                skipped.append((candidate, f"on {tier.name}: {exc}"))
                fallback = "another tier" if tier is not holders[candidate][-1] else "an older checkpoint"
                if step is not None and tier is holders[candidate][-1]:
                    break
                warnings.warn(
                    f"skipping the copy of step {candidate} on tier {tier.name} ({tier.storage.uri}): {exc}; "
                    f"trying {fallback}",
                    TiersaveWarning,
                    stacklevel=3,
                )
                continue
            finally:
                chain.protection.release(tier.index, candidate)
            report = RestoreReport(
                candidate,
                tier.catalog.location(candidate),
                nbytes,
                time.perf_counter() - start,
                in_place,
                skipped,
                tier.name,
            )
            return result, report
    if step is not None and last_error is not None and len(skipped) == 1:
        raise last_error
    raise CorruptCheckpointError(
        "no usable checkpoint: every candidate failed: " + "; ".join(f"step {s} {why}" for s, why in skipped)
    ) from last_error


class Restore:
    """One restore of one checkpoint: choose destinations, read, copy, rebuild."""

    def __init__(self, ckpt: OpenCheckpoint, into: Any, strict: bool) -> None:
        self.ckpt = ckpt
        self.into = into
        self.strict = strict

    def run(self, pool: Executor) -> tuple[Any, int, int]:
        with paused_gc():  # 10^5 tensors make 10^6 small objects; see paused_gc
            return self._run(pool)

    def _run(self, pool: Executor) -> tuple[Any, int, int]:
        manifest = self.ckpt.manifest
        saved = decode_placeholders(manifest.tree)
        targets = match_targets(saved, self.into, strict=self.strict) if self.into is not None else {}
        requests: list[ReadRequest] = []
        dests: dict[str, torch.Tensor | np.ndarray] = {}
        claimed = _Intervals()
        in_place = 0
        no_targets: list[Target] = []
        for name, entry in manifest.tensors.items():
            candidates = targets.get(name, no_targets)
            if not candidates:  # the common case of a new tree: a fresh tensor, read into as it is
                dest_t, view = fresh_tensor(entry.shape, torch_dtype(entry.dtype), entry.nbytes)
                dests[name] = dest_t
                requests.append(ReadRequest(entry, view))
                continue
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
        values: dict[str, Any] = dests if not targets else {}
        cuda = False
        for name, entry in manifest.tensors.items() if targets else ():
            dest = dests[name]
            primary: Any = dest
            for t in targets.get(name, no_targets):
                if t.value is dest or not fits(t.value, entry.dtype, entry.shape):
                    continue
                _copy_into(t.value, dest)
                cuda = cuda or (isinstance(t.value, torch.Tensor) and t.value.device.type == "cuda")
                if primary is dest:
                    primary = t.value
            values[name] = primary
        if cuda:
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


def fresh_tensor(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """A new CPU tensor to restore into and a byte view of its memory (cheaper than :func:`new_tensor` plus
    ``tensor_byte_view``: a restore of 10^5 small tensors makes 10^5 of them)."""
    if nbytes >= _ALIGNED_MIN:
        tensor = new_tensor(shape, dtype, nbytes)
        return tensor, tensor_byte_view(tensor)
    raw = torch.empty(nbytes, dtype=torch.uint8)
    view = raw.numpy().data if nbytes else memoryview(b"")
    return raw.view(dtype).view(shape), view


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
