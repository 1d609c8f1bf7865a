"""Phased staging: a save's tensors copied into the arena in an order of phases, each phase announced.

A lazy save (tiersave/lazy.py) copies the tensors nobody guards on the caller's thread (phase 0), returns,
and copies the rest on a background thread, one phase per guard (module buffers first, then each guarded
optimizer's parameters and state), so that a guard's hook waits only for its own phase. Each tensor is
copied to its final place in the arena (the save fits it: no ring), with the zero padding after it; a
write unit is submitted as soon as every tensor it covers is staged.

Scope: copying a chosen set of one save's tensors into the arena and releasing the writes they complete;
device-to-host copies on a side stream, announced per phase by a CUDA event.
Anti-scope: which tensor belongs to which phase and who waits for it (lazy.py); the layout, the writes and
the checksums (pipeline.py).

The CUDA path (non-blocking copies on a side stream, one event per phase) is written for GPU hosts and is
not exercised by the CPU test suite (tests/gpu runs it where a device exists).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..format.jsonsafe import paused_gc
from ..format.layout import align_up
from .pipeline import StagedWrite
from .stage import small_memmove, source_bytes

_LARGE = 1 << 20  # copies from this size go to the copier's threads; smaller ones run inline


class PhasedStaging:
    """Stages ``job``'s tensors phase by phase: tensor ``i`` in phase ``phase_of[i]`` (0 .. ``phases - 1``).

    Args:
        job: the staged write, whose plan fits its arena (``fits(job)``).
        phase_of: each tensor's phase.
        phases: how many phases.

    Thread safety: one thread runs the phases, in order; :attr:`events` may be read from any thread.
    """

    def __init__(self, job: StagedWrite, phase_of: Sequence[int], phases: int) -> None:
        if not fits(job):
            raise ValueError("phased staging needs a save that fits its staging arena")
        self.job = job
        self.phases = phases
        plan = job.plan
        base = 0
        self._global: list[int] = [0] * len(plan.nbytes)  # each tensor's offset in the save (= in the arena)
        for shard in plan.shards:
            for i in range(shard.first, shard.end):
                self._global[i] = base + plan.offsets[i]
            base += shard.size
        self.members: list[list[int]] = [[] for _ in range(phases)]
        for i, phase in enumerate(phase_of):
            self.members[phase].append(i)
        # a unit is written once its last tensor is staged: after the highest phase among its tensors
        self._units: list[list[Any]] = [[] for _ in range(phases)]
        for u in plan.units:
            last = u.end if u.is_group else u.tensor + 1
            self._units[max(phase_of[u.tensor : last])].append(u)
        self.cuda_events: list[Any] = [None] * phases  # per phase with device copies: recorded after them
        self._stream: Any = None

    def bytes_in(self, phase: int) -> int:
        nbytes = self.job.plan.nbytes
        return sum(nbytes[i] for i in self.members[phase])

    def stage(self, phase: int, after: Any = None) -> None:
        """Copy the tensors of ``phase`` (with their padding) and submit the writes this completes.

        ``after``: a CUDA event recorded on the caller's stream when the save was requested; device copies
        wait for it, so they read the tensors as they were then (not needed on the caller's thread).
        """
        start = time.perf_counter()
        with paused_gc():
            on_cuda = self._copy(self.members[phase], after)
        event = None
        if on_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
            self.cuda_events[phase] = event
        self.job.submit_staged(self._units[phase], event)
        self.job.stage_s += time.perf_counter() - start

    def _copy(self, members: list[int], after: Any) -> bool:
        job = self.job
        plan, addresses, sources, copier = job.plan, job.addresses, job.sources, job.copier
        arena = job.arena_tensor
        arena_ptr = arena.data_ptr()
        copies: list[tuple[int, int, int]] = []
        keep_alive = []  # contiguous copies made by source_bytes must outlive the memmoves
        on_cuda = False
        for i in members:
            n = plan.nbytes[i]
            if not n:
                continue
            where = self._global[i]
            pad = align_up(plan.offsets[i] + n) - plan.offsets[i] - n
            if pad:
                ctypes.memset(arena_ptr + where + n, 0, pad)  # the format's zero padding
            addr = addresses[i]
            if addr is None:
                src = source_bytes(sources[i])
                if src.device.type == "cuda":
                    if self._stream is None:
                        self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                        if after is not None:
                            self._stream.wait_event(after)
                    with torch.cuda.stream(self._stream):
                        arena[where : where + n].copy_(src, non_blocking=True)
                    keep_alive.append(src)
                    on_cuda = True
                    continue
                keep_alive.append(src)
                addr = src.data_ptr()
            if n >= _LARGE and copier is not None:
                copies.append((arena_ptr + where, addr, n))
            else:
                small_memmove(arena_ptr + where, addr, n)
        if copies and copier is not None:
            copier.copy_many(copies)
        if on_cuda:  # the sources must live until the side stream has read them
            for src in keep_alive:
                if src.device.type == "cuda":
                    src.record_stream(self._stream)
        return on_cuda


def fits(job: StagedWrite) -> bool:
    """Whether a save fits its arena whole, the condition of phased staging."""
    return job.plan.total_bytes <= job.ring.capacity
