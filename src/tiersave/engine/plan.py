"""The layout of one save: where each tensor goes in which shard, and the write units that cover the shards.

A save's tensors are cut into *units*, one per checksum chunk (at most ``chunk_bytes``), each padded to
4096 bytes. Because the format places tensor ``i+1`` at ``align_up(end of tensor i)``, the padded units
tile every shard exactly: each unit is one aligned write, and the zero padding the format requires is
written with it.

Small tensors (at most :data:`SMALL_TENSOR_BYTES` and one chunk) are not units of their own: a run of them
in one shard forms a *group* unit spanning at most :data:`GROUP_BYTES`, staged with one copy per tensor and
written, checksummed (one CRC-32C per tensor, as the format wants) and released as one job with one future.
A state of 10^5 expert tensors then costs a copy and a few attribute reads per tensor instead of a job, a
future, a lock and a write each; the bytes on disk are the same.

Scope: the pure planning of a save (offsets, shards, units), from each tensor's name, dtype, shape and size.
Anti-scope: moving bytes (pipeline.py stages and writes them, unstaged.py writes them from the sources),
flattening the state (state.py), reusing a plan between saves (savelayout.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..format.jsonsafe import paused_gc
from ..format.layout import ALIGN, align_up


@dataclass(slots=True)
class Unit:
    """One write of a save: either one checksum chunk of one tensor (the bytes ``[src_start, src_start +
    length)`` of tensor ``tensor``), or a *group* of consecutive small tensors ``tensor .. end - 1`` (each one
    chunk, laid out back to back at their aligned offsets). Either way it is written at ``file_offset`` of its
    shard as ``padded`` bytes, zero padding included."""

    tensor: int
    chunk: int
    shard: int
    file_offset: int
    global_offset: int
    src_start: int
    length: int
    padded: int
    end: int = -1  # a group's one-past-last tensor; -1 for a chunk of one tensor

    @property
    def is_group(self) -> bool:
        return self.end >= 0


SMALL_TENSOR_BYTES = 1 << 20
"""Tensors up to this size (and one checksum chunk) are staged, checksummed and written in groups: their cost
per tensor is then a few attribute reads and one copy, not a job, a future and a write each."""

GROUP_BYTES = 8 << 20
"""The most bytes (padding included) one group of small tensors spans: one write, one job."""


@dataclass
class ShardLayout:
    """One shard file of a save: its name, its size (a multiple of 4096) and the tensors in it (indices
    ``first .. end - 1``: the layout places tensors in order)."""

    file: str
    size: int
    first: int = 0
    end: int = 0


def plan_layout(
    nbytes: Sequence[int], files: Callable[[int], str], *, max_shard_bytes: int | None = None
) -> tuple[list[ShardLayout], list[int]]:
    """Place tensors in order at 4 KiB-aligned offsets (docs/format.md section 3), starting a new shard
    past ``max_shard_bytes``. Returns the shards and each tensor's offset in its shard."""
    shards: list[ShardLayout] = []
    offsets = [0] * len(nbytes)
    cursor = 0
    for index, size in enumerate(nbytes):
        if not shards or (max_shard_bytes is not None and cursor > 0 and cursor + size > max_shard_bytes):
            if shards:
                shards[-1].size, shards[-1].end = cursor, index
            shards.append(ShardLayout(files(len(shards)), 0, index, index))
            cursor = 0
        offsets[index] = cursor
        cursor = -(-(cursor + size) // ALIGN) * ALIGN
    if shards:
        shards[-1].size, shards[-1].end = cursor, len(nbytes)
    return shards, offsets


class TensorSpec(Protocol):
    """What the planner needs of a tensor to save (``state.FlatTensor`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...


@dataclass
class SavePlan:
    """Where every tensor of a save goes. ``names[i]`` is tensor ``i``, at ``offsets[i]`` of shard
    ``shard_of[i]``; units are in global order."""

    names: list[str]
    nbytes: list[int]
    shards: list[ShardLayout]
    units: list[Unit]
    chunk_bytes: int
    offsets: list[int] = field(default_factory=list)
    shard_of: list[int] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)


def plan_save(
    tensors: Sequence[TensorSpec],
    *,
    chunk_bytes: int,
    shard_file: Callable[[int], str],
    max_shard_bytes: int | None = None,
    small_bytes: int = SMALL_TENSOR_BYTES,
    group_bytes: int = GROUP_BYTES,
) -> SavePlan:
    """Lay out tensors (docs/format.md offsets) and cut them into units: runs of consecutive small tensors
    (at most ``small_bytes`` each, one checksum chunk) in one shard become one group unit spanning at most
    ``group_bytes``; larger tensors get one unit per checksum chunk."""
    if chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes {chunk_bytes} is not a multiple of {ALIGN}")
    with paused_gc():
        return _plan(tensors, chunk_bytes, shard_file, max_shard_bytes, small_bytes, group_bytes)


def _plan(
    tensors: Sequence[TensorSpec],
    chunk_bytes: int,
    shard_file: Callable[[int], str],
    max_shard_bytes: int | None,
    small_bytes: int,
    group_bytes: int,
) -> SavePlan:
    names = [t.name for t in tensors]
    nbytes = [t.nbytes for t in tensors]
    shards, offsets = plan_layout(nbytes, shard_file, max_shard_bytes=max_shard_bytes)
    plan = SavePlan(
        names, nbytes, shards, [], chunk_bytes, offsets, [0] * len(names), [t.dtype for t in tensors],
        [t.shape for t in tensors],
    )  # fmt: skip
    small = min(small_bytes, chunk_bytes)
    span_limit = max(ALIGN, min(group_bytes, chunk_bytes))
    units = plan.units
    shard_of = plan.shard_of
    base = 0
    for s, shard in enumerate(shards):
        first = -1  # the open group: its first tensor, start offset and end of its last tensor's data
        g_start = g_end = 0
        shard_of[shard.first : shard.end] = [s] * (shard.end - shard.first)
        for index, size, offset in zip(
            range(shard.first, shard.end), nbytes[shard.first : shard.end], offsets[shard.first : shard.end]
        ):
            if size <= small:
                if first >= 0 and -(-(offset + size) // ALIGN) * ALIGN - g_start <= span_limit:  # align_up inline
                    g_end = offset + size
                    continue
                if first >= 0:
                    _group(units, first, index, s, g_start, g_end, base)
                first, g_start, g_end = index, offset, offset + size
                continue
            if first >= 0:
                _group(units, first, index, s, g_start, g_end, base)
                first = -1
            for c, start in enumerate(range(0, size, chunk_bytes)):
                length = min(chunk_bytes, size - start)
                off = offset + start
                units.append(Unit(index, c, s, off, base + off, start, length, align_up(length)))
        if first >= 0:
            _group(units, first, shard.end, s, g_start, g_end, base)
        base += shard.size
    return plan


def _group(units: list[Unit], first: int, end: int, shard: int, start: int, data_end: int, base: int) -> None:
    length = data_end - start
    if length:  # a run of empty tensors has nothing to write
        units.append(Unit(first, 0, shard, start, base + start, 0, length, align_up(length), end))
