"""A restore's destinations: which live tensor each stored tensor is read into, and fresh memory for the rest.

Scope: matching a decoded tree's tensor placeholders to the live tensors at the same place (``match_targets``),
whether a live tensor can take a stored tensor's bytes in place (``fits``, ``readable_in_place``), choosing
among live tensors that share memory so that no memory is read into twice (``first_free``), new tensors to
read into and byte views of them. The work is per tensor and a state may hold 10^5 tensors: each step is a
few attribute reads, and what can be decided for all tensors at once is (one sort for the shared memory).
Anti-scope: the tree encoding and applying a restored tree (state.py), pruning to a part (partial.py),
reading bytes (engine/), the order of a restore (restore.py).
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import StateMismatchError
from .format.dtypes import NUMPY_TO_NAME
from .format.layout import ALIGN
from .state import _ARRAYS, _DTYPE_NAMES, _path_join, _Ref, _StatefulNode, is_stateful


@dataclass(slots=True)
class Target:
    """A live tensor (or array) a stored tensor should be restored into."""

    value: torch.Tensor | np.ndarray
    path: str
    strict: bool  # True: a mismatch is an error; False (inside a stateful object): load_state_dict decides


def match_targets(saved: Any, into: Any, *, strict: bool = True) -> dict[str, list[Target]]:
    """Find, for each stored tensor name, the live tensors in ``into`` at the same place.

    A stateful object in ``into`` is matched through its current ``state_dict()``, whose tensors alias
    the live parameters and optimizer state, so the bytes land in place.

    Raises:
        StateMismatchError: ``into`` has keys the checkpoint lacks (when ``strict``).
    """
    targets: dict[str, list[Target]] = {}

    def walk(s: Any, live: Any, path: str, in_stateful: bool) -> None:
        if is_stateful(live):
            walk(s.state if isinstance(s, _StatefulNode) else s, live.state_dict(), path, True)
            return
        if isinstance(s, _StatefulNode):
            walk(s.state, live, path, in_stateful)
            return
        if isinstance(s, _Ref):
            if isinstance(live, _ARRAYS):
                targets.setdefault(s.name, []).append(Target(live, path, not in_stateful))
            return
        if isinstance(s, dict) and isinstance(live, dict):
            # a set comparison in C per dict; dict.keys, not live.keys: a subclass may return a list
            if strict and not in_stateful and not dict.keys(live) <= s.keys():
                missing = [k for k in live if k not in s]
                if missing:
                    raise StateMismatchError(
                        f"the checkpoint has no {', '.join(repr(_path_join(path, k)) for k in missing[:5])}"
                        + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
                        + "; pass strict=False to restore the rest"
                    )
            for k, v in s.items():
                if k not in live:
                    continue
                lv = live[k]
                if type(v) is _Ref and isinstance(lv, _ARRAYS):  # a tensor's leaf (most of a state), inline
                    targets.setdefault(v.name, []).append(Target(lv, _path_join(path, k), not in_stateful))
                else:
                    walk(v, lv, _path_join(path, k), in_stateful)
            return
        if isinstance(s, (list, tuple)) and isinstance(live, (list, tuple)):
            for i, (sv, lv) in enumerate(zip(s, live)):
                walk(sv, lv, _path_join(path, i), in_stateful)

    walk(saved, into, "", False)
    return targets


def fits(target: torch.Tensor | np.ndarray, dtype: str, shape: tuple[int, ...]) -> bool:
    """Whether ``target`` has a stored tensor's dtype and shape (the bytes can land in it bit for bit)."""
    if isinstance(target, torch.Tensor):
        name = _DTYPE_NAMES.get(target.dtype) or str(target.dtype).removeprefix("torch.")
        return name == dtype and target.shape == shape  # a torch.Size is a tuple
    return NUMPY_TO_NAME.get(target.dtype.name) == dtype and tuple(target.shape) == shape


def readable_in_place(target: torch.Tensor | np.ndarray) -> bool:
    """True when bytes can be read straight into ``target``'s memory."""
    if isinstance(target, np.ndarray):
        return bool(target.flags.c_contiguous and target.flags.writeable and target.dtype.byteorder in "=|<")
    return (
        target.is_cpu
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
        and target.layout == torch.strided
        and not target.is_quantized
    )


def first_free(choices: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """For each item in order, the index of its first half-open byte range ``(start, end)`` that overlaps no range
    an item before it took (-1: each one does); the range chosen is then taken. An empty range takes nothing.

    The stored tensors of a restore and the live tensors each could be read into: a live tensor whose memory
    another stored tensor already fills (tied in the live model) is not read into twice. Live tensors rarely
    share memory, so one sort finds the items whose ranges overlap no other item's (they take their first);
    only the rest are taken one by one, in order.
    """
    picks = [0 if spans else -1 for spans in choices]
    ranges = sorted((start, end, i) for i, spans in enumerate(choices) for start, end in spans if end > start)
    contested: set[int] = set()  # items with a range overlapping another item's (through a chain of overlaps)
    first = end_max = -1  # the current cluster of overlapping ranges: where it starts in ranges, where it ends
    mixed = False  # whether it holds ranges of more than one item
    for j, (start, end, i) in enumerate(ranges):
        if start >= end_max:
            if mixed:
                contested.update(item for _, _, item in ranges[first:j])
            first, end_max, mixed = j, end, False
        else:
            mixed = mixed or i != ranges[first][2]
            end_max = max(end_max, end)
    if mixed:
        contested.update(item for _, _, item in ranges[first:])
    taken = _Intervals()
    for i in sorted(contested):
        picks[i] = -1
        for k, (start, end) in enumerate(choices[i]):
            if end > start:
                if taken.overlaps(start, end):
                    continue
                taken.add(start, end)
            picks[i] = k
            break
    return picks


class _Intervals:
    """Disjoint half-open byte ranges, with an O(log n) overlap test."""

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
        return tensor, cpu_byte_view(tensor)
    if dtype is torch.complex32:  # torch.empty warns that it is experimental; a view of bytes does not
        raw = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        return raw.view(dtype).view(shape), cpu_byte_view(raw)
    tensor = torch.empty(shape, dtype=dtype, device="cpu")  # not the default device: the bytes are read here
    return tensor, cpu_byte_view(tensor)


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """An uninitialized tensor to restore into; page-aligned when large, so direct I/O reads land in it
    with no bounce copy (torch's own allocations start a few bytes past a page boundary)."""
    if nbytes < _ALIGNED_MIN:  # device="cpu": a `with torch.device(...)` around the restore must not move it
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device="cpu", pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start : start + nbytes].view(dtype).view(shape)


def span(value: torch.Tensor | np.ndarray) -> tuple[int, int]:
    """The half-open range of addresses ``value``'s bytes occupy (contiguous: ``readable_in_place``)."""
    if isinstance(value, np.ndarray):
        start = int(value.__array_interface__["data"][0])
        return start, start + value.nbytes
    start = value.data_ptr()
    return start, start + value.nbytes


def cpu_byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU, contiguous tensor (``readable_in_place``) as a flat ``memoryview`` of its memory.

    The same view as ``tensor_byte_view`` at a sixth of its cost (a restore into a live state of 10^5 small
    tensors makes 10^5 of them): a ctypes array over the tensor's memory that holds the tensor, so the memory
    outlives every use of the view."""
    if not t.is_cpu:  # a device pointer read as host memory would be written by the reader threads
        raise TypeError(f"cpu_byte_view needs a CPU tensor, got one on {t.device}")
    nbytes = t.nbytes
    if not nbytes:
        return memoryview(b"")
    memory = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    memory._tensor = t  # type: ignore[attr-defined]  # ctypes keeps the view's exporter, this keeps the tensor
    return memoryview(memory).cast("B")
