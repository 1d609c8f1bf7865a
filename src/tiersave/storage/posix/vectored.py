"""Vectored direct reads: one ``preadv`` fills a run of consecutive ranges of a file, each in its own buffer.

Scope: :func:`pread_ranges_direct`, which reads sorted, non-overlapping file ranges (tensors laid out one
after another in a shard) with few large direct requests: every aligned part of a range whose buffer is
aligned lands in place, everything else (unaligned buffers, the unaligned edges of a range, the padding
between ranges) goes through bounce buffers and is copied out. Anti-scope: choosing direct or buffered
(:mod:`tiersave.storage.posix.policy`), the single-range path (:func:`~tiersave.storage.posix.directio.pread_direct`),
checksums (the engine; given sinks, each range's bytes are handed to its sink in file order, which takes them).

Why: a run of experts becomes a few jobs and requests instead of one per tensor. End to end, a restore of
256 experts of 4 MiB went from 1.19x to 0.94x the time of the same bytes in four tensors (docs/benchmarks.md,
"Many tensors: the MoE restore"); how much of that the device itself gives varies: in one run here it served
4 MiB requests from four threads at 1.0 GB/s and 64 MiB ones (or 4 MiB buffers 16 to a ``preadv``) at 1.8
GB/s, in three later runs all three at the same rate (``benchmarks/vectored_reads.py``).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
from collections.abc import Sequence

from ...format.layout import align_up
from .buffers import address_of
from .directio import BouncePool, DioAlignment, ReadSink

__all__ = ["MAX_IOVECS", "pread_ranges_direct"]

MAX_IOVECS = 512
"""Buffers per ``preadv`` (Linux accepts 1024)."""

Piece = tuple[int, memoryview]
"""``(file offset, buffer)``: one range to fill, or one iovec of a ``preadv``."""


def pread_ranges_direct(
    fd: int,
    ranges: Sequence[Piece],
    alignment: DioAlignment,
    pool: BouncePool,
    *,
    bounce_buffers: int = 1,
    sinks: Sequence[ReadSink] | None = None,
) -> tuple[int, int, int]:
    """Fill each ``(offset, view)`` of ``ranges`` (``B`` views, sorted by offset, not overlapping) with the
    file's bytes there, by direct ``preadv`` calls over the span that holds them.

    Each call moves every in-place part up to the next stretch that needs bouncing, and bounced bytes up to
    ``bounce_buffers`` of the pool's blocks (taken only when some bytes need them). With ``sinks`` (one per
    range), each range's sink sees every byte of it in file order: it copies the bounced ones out, and is
    told of the ones read in place.

    Returns:
        ``(in_place, bounced, end)``: bytes read straight into the views, bytes copied out of bounce
        buffers, and the file offset up to which bytes were read (short of the last range's end only
        when the file ends first: the caller names the range left short).

    Raises:
        ValueError: the ranges overlap or are not sorted.
        OSError: a read failed (``is_refusal`` tells whether to retry buffered).
    """
    if not ranges:
        return 0, 0, 0
    align, mem_align = alignment.offset, alignment.memory
    span_start = ranges[0][0] - ranges[0][0] % align
    # The span is tiled by "direct" parts (aligned file range into an aligned buffer, read in place) and
    # the stretches between them, bounced; both kinds start and end on aligned file offsets.
    direct: list[Piece] = []
    prev_end = span_start
    for off, view in ranges:
        if off < prev_end:
            raise ValueError(f"ranges overlap or are not sorted at file offset {off}")
        end = off + len(view)
        d0, d1 = align_up(off, align), end - end % align
        if d1 > d0 and (address_of(view) + d0 - off) % mem_align == 0:
            direct.append((d0, view[d0 - off : d1 - off]))
        prev_end = end
    span_end = align_up(prev_end, align)
    in_place = sum(len(v) for _, v in direct)
    bounced = sum(len(v) for _, v in ranges) - in_place
    bounce_total = span_end - span_start - in_place
    wanted = min(bounce_buffers, -(-bounce_total // pool.block_bytes))
    cursor, di = span_start, 0
    with contextlib.ExitStack() as stack:
        bounces = [stack.enter_context(pool.acquire()) for _ in range(max(0, wanted))]
        while cursor < span_end:
            pieces, via_bounce, di = _window(cursor, span_end, direct, di, bounces)
            window_end = pieces[-1][0] + len(pieces[-1][1])
            got = _preadv_all(fd, [m for _, m in pieces], cursor, align)
            if sinks is None:
                _copy_out(ranges, via_bounce, cursor + got)
            else:
                _deliver(ranges, sinks, pieces, {id(p) for p in via_bounce}, cursor + got)
            if cursor + got < window_end:
                return in_place, bounced, cursor + got
            cursor = window_end
    return in_place, bounced, prev_end


def _window(
    cursor: int, span_end: int, direct: list[Piece], di: int, bounces: list[memoryview]
) -> tuple[list[Piece], list[Piece], int]:
    """The iovecs of one ``preadv`` from ``cursor``: in-place parts as they come, bounced stretches until
    the bounce buffers are full or ``MAX_IOVECS`` are used.

    Returns:
        All pieces, the bounced ones, and the index of the next direct part.
    """
    pieces: list[Piece] = []
    bounced: list[Piece] = []
    slot = used = 0
    pos = cursor
    while pos < span_end and len(pieces) < MAX_IOVECS:
        if di < len(direct) and direct[di][0] == pos:
            pieces.append(direct[di])
            pos += len(direct[di][1])
            di += 1
            continue
        if slot < len(bounces) and used == len(bounces[slot]):
            slot, used = slot + 1, 0
        if slot == len(bounces):
            break
        stop = direct[di][0] if di < len(direct) else span_end
        take = min(stop - pos, len(bounces[slot]) - used)
        piece = (pos, bounces[slot][used : used + take])
        pieces.append(piece)
        bounced.append(piece)
        used += take
        pos += take
    return pieces, bounced, di


def _preadv_all(fd: int, iovs: list[memoryview], offset: int, align: int) -> int:
    """``preadv`` until every buffer is full or the file ends; returns the bytes read."""
    total = sum(len(m) for m in iovs)
    done = 0
    while done < total:
        n = os.preadv(fd, iovs, offset + done)
        if n <= 0:
            break
        done += n
        if done < total and n % align:
            break  # a short direct read off a block boundary is the end of the file
        while n:  # drop what this call filled
            if n >= len(iovs[0]):
                n -= len(iovs[0])
                iovs.pop(0)
            else:
                iovs[0] = iovs[0][n:]
                n = 0
    return done


def _copy_out(ranges: Sequence[Piece], bounced: list[Piece], hi: int) -> None:
    """Copy the bytes before file offset ``hi`` that landed in bounce buffers into the ranges holding them."""
    if not bounced:
        return
    starts = [off for off, _ in ranges]
    for p0, mem in bounced:
        p1 = min(p0 + len(mem), hi)
        i = max(0, bisect.bisect_right(starts, p0) - 1)
        while i < len(ranges) and ranges[i][0] < p1:
            off, view = ranges[i]
            a, b = max(off, p0), min(off + len(view), p1)
            if b > a:  # ctypes.memmove releases the GIL: other readers' copies and checksums go on meanwhile
                ctypes.memmove(address_of(view[a - off :]), address_of(mem[a - p0 :]), b - a)
            i += 1


def _deliver(
    ranges: Sequence[Piece], sinks: Sequence[ReadSink], pieces: list[Piece], bounced: set[int], hi: int
) -> None:
    """Hand every byte before file offset ``hi`` of one ``preadv``'s ``pieces`` to the sink of its range, in
    file order (so that a range's head, in-place middle and tail reach its sink in that order); bounced
    pieces (their ``id`` in ``bounced``) are copied out by the sink."""
    starts = [off for off, _ in ranges]
    for piece in pieces:
        p0, mem = piece
        p1 = min(p0 + len(mem), hi)
        i = max(0, bisect.bisect_right(starts, p0) - 1)
        while i < len(ranges) and ranges[i][0] < p1:
            off, view = ranges[i]
            a, b = max(off, p0), min(off + len(view), p1)
            if b > a:
                if id(piece) in bounced:
                    sinks[i].copy(view[a - off : b - off], mem[a - p0 : b - p0])
                else:  # an in-place part: ``mem`` is a slice of this range's own view
                    sinks[i].landed(mem[a - p0 : b - p0])
            i += 1
