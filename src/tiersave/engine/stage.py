"""Staging: the only part of a save the training loop waits for.

Scope: a reusable, page-aligned host arena (pinned when the state has CUDA tensors) bounded by a memory
budget, used as a ring over a save's bytes; copying tensors into it chunk by chunk (device-to-host copies
are non-blocking on a side stream); and the bookkeeping that lets writers free ring space as they finish.
Anti-scope: where the bytes go (engine/pipeline.py), what they mean (state.py, format/).

Memory: the arena is allocated once, sized ``min(budget, bytes of the save)``, and reused by every
later save, so host memory neither doubles the state behind the user's back nor grows across saves. A
state larger than the budget streams through the ring: staging then waits for writers to free space
(back-pressure), and the caller blocks for longer instead of the process running out of memory.

Thread safety: one save stages at a time (the Checkpointer guarantees it); ``Ring`` is shared between
the staging thread and the writer threads and is internally locked.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from itertools import repeat
from operator import add
from typing import Any, TypeVar

import numpy as np
import torch

from ..errors import ConfigError
from ..format.checksum import copy_checksum, crc32c_combine
from ..format.layout import ALIGN, align_up
from .memcopy import CopyFn, large_copy

log = logging.getLogger(__name__)


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo, or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_budget(save_bytes: int) -> int:
    """The staging budget when none is configured: one full copy of the save, but at most half of the
    memory available now (``TIERSAVE_STAGING_BYTES`` overrides)."""
    env = os.environ.get("TIERSAVE_STAGING_BYTES")
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ConfigError(f"TIERSAVE_STAGING_BYTES={env!r} is not an integer") from None
        if value < 2 * ALIGN:
            raise ConfigError(f"TIERSAVE_STAGING_BYTES={value} is below the minimum of {2 * ALIGN}")
        return value
    avail = available_memory_bytes()
    cap = avail // 2 if avail else save_bytes
    return max(2 * ALIGN, min(save_bytes, cap))


class StagingArena:
    """Page-aligned host memory reused across saves; pinned (page-locked) when CUDA tensors are staged.

    Args:
        budget_bytes: the most host memory staging may use; None chooses per save (:func:`default_budget`).
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 2 * ALIGN:
            raise ConfigError(f"staging budget must be at least {2 * ALIGN} bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._tensor: torch.Tensor | None = None
        self._pinned = False
        self.allocations = 0

    @property
    def capacity(self) -> int:
        return 0 if self._tensor is None else int(self._tensor.numel())

    @property
    def pinned(self) -> bool:
        return self._pinned

    def budget_for(self, save_bytes: int) -> int:
        budget = self.budget_bytes if self.budget_bytes is not None else default_budget(save_bytes)
        return max(2 * ALIGN, budget - budget % ALIGN)

    def reserve(self, save_bytes: int, *, pinned: bool, min_bytes: int) -> torch.Tensor:
        """A uint8 tensor over the arena, at least ``min(budget, save_bytes)`` and ``min_bytes`` long.

        Reuses the current allocation when it is large enough (and pinned if required); otherwise frees
        it and allocates anew. The first touch of fresh pages is paid here, once, not on every save.
        """
        want = max(min(self.budget_for(save_bytes), align_up(save_bytes)), min_bytes)
        if self._tensor is not None and self.capacity >= want and (self._pinned or not pinned):
            return self._tensor
        self.release()
        self._tensor = _aligned_tensor(want, pinned)
        self._pinned = pinned
        self.allocations += 1
        log.debug("staging arena: allocated %d bytes (pinned=%s)", want, pinned)
        return self._tensor

    def release(self) -> None:
        self._tensor = None


def _aligned_tensor(nbytes: int, pinned: bool) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pinned)
    start = (-raw.data_ptr()) % ALIGN
    view = raw[start : start + nbytes]
    view.zero_()  # fault the pages in now, once, rather than inside the first save's copies
    return view


class Ring:
    """Which part of the arena is free, for a save whose bytes are laid out over ``[0, total)``.

    Global offset ``g`` lives at arena position ``g % capacity``. The staging thread calls
    :meth:`wait_free` before copying a unit; writer threads call :meth:`release` when a unit is on
    storage. Units cover ``[0, total)`` exactly, so the released ranges advance one watermark.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._freed = 0
        self._done: dict[int, int] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self.waited_s = 0.0
        self.on_fail: list[Callable[[BaseException], object]] = []  # called once, with the first failure

    def segments(self, start: int, length: int) -> list[tuple[int, int]]:
        """Arena ``(position, length)`` pieces of the global range ``[start, start + length)``."""
        pos = start % self.capacity
        first = min(length, self.capacity - pos)
        return [(pos, first)] if first == length else [(pos, first), (0, length - first)]

    def wait_free(self, end: int) -> None:
        """Block until every byte below ``end - capacity`` has been written (or a writer failed)."""
        import time

        with self._cond:
            if end - self.capacity <= self._freed and self._error is None:
                return
            t0 = time.perf_counter()
            while end - self.capacity > self._freed and self._error is None:
                self._cond.wait()
            self.waited_s += time.perf_counter() - t0
            if self._error is not None:
                raise self._error

    def release(self, start: int, end: int) -> None:
        with self._cond:
            self._done[start] = end
            while self._freed in self._done:
                self._freed = self._done.pop(self._freed)
            self._cond.notify_all()

    @property
    def failed(self) -> bool:
        """Whether a writer has failed (:meth:`fail`)."""
        return self._error is not None

    def fail(self, exc: BaseException) -> None:
        """Wake the staging thread with a writer's error (and, the first time, call ``on_fail`` with it)."""
        with self._cond:
            first = self._error is None
            if first:
                self._error = exc
            self._cond.notify_all()
        if first:
            for callback in self.on_fail:
                callback(exc)


class HostCopier:
    """Copies host memory on a small pool of daemon threads, with the streaming copy where it was built
    (engine/memcopy.py: non-temporal stores; ``routine`` names the one chosen) for copies of at least
    ``_STREAM_MIN`` bytes in all, and ``memmove`` for the rest.

    Staging copies of CPU tensors go through this instead of ``Tensor.copy_``: torch's copy runs on the
    OpenMP pool, whose threads spin-wait between parallel regions and, on a machine with few cores, fight
    the I/O threads that are writing earlier chunks at the same moment (measured here: staging 5-15x
    slower than a bare copy). Both copy routines are ctypes calls that release the GIL, so large copies
    split across threads run in parallel, and nothing spins.

    Thread safety: ``copy`` may be called from one thread at a time (the staging thread).
    """

    _PIECE = 16 << 20  # smaller copies run inline: handing them to a thread costs more than it saves

    def __init__(self, threads: int | None = None) -> None:
        from .pool import DaemonThreadPool

        count = threads if threads is not None else min(4, os.cpu_count() or 1)
        self.threads = max(1, count)
        self._stream, self.routine = large_copy()
        self._pool = DaemonThreadPool(self.threads - 1, "tiersave-stage") if self.threads > 1 else None

    def _parts(self, nbytes: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of the parts one copy of ``nbytes`` is split into, one per thread (a single
        part below ``_PIECE`` per thread)."""
        pieces = min(self.threads, nbytes // self._PIECE) if self._pool is not None else 1
        if pieces <= 1:
            return [(0, nbytes)]
        size = -(-nbytes // pieces)
        size += (-size) % ALIGN
        return [(off, min(size, nbytes - off)) for off in range(0, nbytes, size)]

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` to address ``dst`` (non-overlapping host memory)."""
        copy = self._routine_for(nbytes)
        (_, first), *rest = self._parts(nbytes)
        futures = [self._pool.submit(copy, dst + off, src + off, n) for off, n in rest]  # type: ignore[union-attr]
        copy(dst, src, first)  # the first part on this thread
        for fut in futures:
            fut.result()

    def copy_checksum(self, arena: memoryview, arena_ptr: int, pos: int, src: int, nbytes: int) -> int:
        """Copy ``nbytes`` from address ``src`` to ``arena[pos:]`` (``arena_ptr`` is its address) and return
        the CRC-32C of the bytes copied.

        One pass instead of two (``copy_checksum``: each piece checksummed while it is in cache). Large copies
        are split over the threads as :meth:`copy` splits them; the parts' checksums are combined into one."""
        (_, first), *rest = self._parts(nbytes)
        futures = [
            (self._pool.submit(copy_checksum, 0, arena[pos + off : pos + off + n], arena_ptr + pos + off, src + off), n)  # type: ignore[union-attr]
            for off, n in rest
        ]
        crc = copy_checksum(0, arena[pos : pos + first], arena_ptr + pos, src)  # the first part on this thread
        for fut, n in futures:
            crc = crc32c_combine(crc, fut.result(), n)
        return crc

    def copy_many(self, copies: list[tuple[int, int, int]]) -> None:
        """Run many ``(dst, src, nbytes)`` copies over the threads (:meth:`_share`)."""
        self._share(partial(_copy_from, self._routine_for(sum(n for _, _, n in copies))), copies)

    def _routine_for(self, nbytes: int) -> CopyFn:
        """The streaming copy for ``nbytes`` of at least ``_STREAM_MIN``, else ``memmove``."""
        return self._stream if nbytes >= _STREAM_MIN else ctypes.memmove

    def copy_changed(self, copies: list[tuple[int, int, int]]) -> list[bool]:
        """Like :meth:`copy_many`, but each destination is first compared with its source (``memcmp``, piece
        by piece) and only the pieces that differ are copied. Returns, per copy, True when its destination
        already held every byte. Reading both buffers costs about what copying one does, and the answer is
        exact: an incremental save learns here that a chunk equals the previous save's staged bytes."""
        if _memcmp is None:  # no C library to call: plain copies, nothing known to be equal
            self.copy_many(copies)
            return [False] * len(copies)
        changed = set().union(*self._share(_copy_changed_from, copies))
        return [i not in changed for i in range(len(copies))]

    def _share(self, run: Callable[[deque[_Piece]], T], copies: list[tuple[int, int, int]]) -> list[T]:
        """Cut ``(dst, src, nbytes)`` copies into ``(dst, src, nbytes, index)`` pieces of at most ``_SHARE`` bytes
        in one queue, and ``run`` it on this thread and on each copier thread (this one alone for less than
        two ``_PIECE``); returns what each ``run`` returned.

        Shared, not dealt out in equal halves: on a virtual machine one of two threads often copies at half
        the other's speed for a whole save (measured on the bench's 3 GB state: 146 against 278 ms, and 284
        against 164, for halves of equal bytes), and the caller waited for the slower; from a queue the faster
        thread copies more and both finish within a piece of each other."""
        share = _SHARE
        work = deque(
            (d + o, s + o, min(share, n - o), i) for i, (d, s, n) in enumerate(copies) for o in range(0, n, share)
        )
        pool = self._pool if sum(n for _, _, n in copies) >= 2 * self._PIECE else None
        futures = [pool.submit(run, work) for _ in range(self.threads - 1)] if pool is not None else []
        return [run(work), *(fut.result() for fut in futures)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _gil_holding_memmove() -> Any:
    """``memmove`` called with the GIL held, for copies of small tensors (at most a few hundred KiB).

    ``ctypes.memmove`` releases and retakes the GIL on every call: for a 1 KiB copy that costs more than the
    copy, and on a loaded machine each retake waits behind the writer threads (measured: 1.4-1.7 us against
    1.05 us per 1 KiB tensor with one other thread running). Where the C library cannot be opened this way
    the ordinary ``ctypes.memmove`` copies the same bytes.
    """
    try:
        fn = ctypes.PyDLL(None).memmove
    except (OSError, AttributeError, TypeError):  # no dlopen(NULL) here (not Linux or macOS)
        return ctypes.memmove
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = ctypes.c_void_p
    return fn


small_memmove = _gil_holding_memmove()


def copy_small(base: int, offsets: list[int], addresses: list[int | None], nbytes: list[int]) -> list[int]:
    """Copy small tensors of host memory to ``base + offsets[i]``, ``nbytes[i]`` bytes from ``addresses[i]``
    each (a group of a save's small tensors into its place in the arena); returns the positions of those
    with bytes but no address, which the caller copies from a byte view.

    The whole group is one ``map`` over the three lists: no Python bytecode per tensor, only the foreign call
    (a ``for`` loop with its tuple unpacking cost as much again for 1 KiB tensors).
    """
    if None not in addresses and 0 not in nbytes:
        deque(map(small_memmove, map(add, repeat(base), offsets), addresses, nbytes), 0)
        return []
    rest = []
    for i, (offset, addr, n) in enumerate(zip(offsets, addresses, nbytes)):
        if not n:
            continue
        if addr is None:
            rest.append(i)
        else:
            small_memmove(base + offset, addr, n)
    return rest


_STREAM_MIN = 64 << 20
"""Copies of fewer bytes in all use ``memmove``, which leaves them in the cache: the writers read the staged bytes
back (the CRC, a buffered write), and a copy that fits a last-level cache (32 MiB here) is still there when
they do. Above it the bytes are evicted before the writers reach them, and streaming stores save a read."""

_SHARE = 8 << 20
"""The piece :meth:`HostCopier.copy_many` hands out: half a millisecond of copying here, so the threads end
within about that of each other, for a GIL hand-off and a ``memmove`` call per 8 MiB."""


_Piece = tuple[int, int, int, int]
"""``(dst, src, nbytes, index)``: a piece of the copy ``index`` of a :meth:`HostCopier._share`."""

T = TypeVar("T")


def _copy_from(copy: CopyFn, work: deque[_Piece]) -> None:
    """A copier thread: take pieces from ``work`` and ``copy`` them until none is left."""
    while True:
        try:
            dst, src, n, _ = work.popleft()
        except IndexError:
            return
        copy(dst, src, n)


def _libc_memcmp() -> Any:
    """``memcmp`` of the C library, called without the GIL (None where it cannot be opened)."""
    try:
        fn = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = ctypes.c_int
    return fn


_memcmp = _libc_memcmp()
_COMPARE_PIECE = 1 << 20  # a change copies only its MiB; the call per MiB costs a microsecond or two


def _copy_changed_from(work: deque[_Piece]) -> set[int]:
    """A copier thread: take pieces from ``work`` until none is left and copy the parts of each that differ; the
    indices of the copies that had any."""
    changed: set[int] = set()
    memcmp, memmove, step = _memcmp, ctypes.memmove, _COMPARE_PIECE
    while True:
        try:
            dst, src, n, index = work.popleft()
        except IndexError:
            return changed
        for off in range(0, n, step):
            take = min(step, n - off)
            if memcmp(dst + off, src + off, take):
                memmove(dst + off, src + off, take)
                changed.add(index)


def source_bytes(source: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A flat, contiguous uint8 tensor over a value's bytes, on the value's device (copies only when the
    value is not contiguous or carries a conj/neg bit)."""
    from ..state import as_bits

    if isinstance(source, np.ndarray):
        arr = np.ascontiguousarray(source)
        return torch.from_numpy(arr.reshape(-1).view(np.uint8))
    t = source.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = as_bits(t)
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def needs_pinned(sources: list[Any]) -> bool:
    return any(isinstance(s, torch.Tensor) and s.device.type == "cuda" for s in sources)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def host_addresses(sources: list[Any]) -> tuple[list[int | None], bool]:
    """For each value, the address of its bytes when they can be copied as they lie (host memory, C-contiguous,
    no conj/neg bit), else None (then :func:`source_bytes` makes a view or a copy); and whether any value is on
    a CUDA device (staging then needs pinned memory).

    One pass of a few attribute reads per value: a state of 10^5 small tensors pays this per tensor, not a
    ``detach``/``reshape``/``view`` chain.
    """
    addresses: list[int | None] = []
    append = addresses.append
    cuda = False
    for s in sources:
        if type(s) in _PLAIN_TENSORS:
            if s.is_cpu:
                plain = s.is_contiguous() and not s.is_conj() and not s.is_neg()
                append(s.data_ptr() if plain else None)
                continue
            cuda = cuda or s.device.type == "cuda"
            append(None)
        elif isinstance(s, np.ndarray) and s.flags.c_contiguous:
            append(int(s.__array_interface__["data"][0]))
        else:
            cuda = cuda or (isinstance(s, torch.Tensor) and s.device.type == "cuda")
            append(None)
    return addresses, cuda
