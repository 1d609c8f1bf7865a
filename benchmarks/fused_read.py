"""A restore's checksum taken in the copy out of the bounce buffer, or in a second pass: side by side (issue 16).

Saves the `tiersave bench` state (llama3-8b scaled to ``--size`` GB) once, then restores it from a cold page
cache ``--reps`` times into the live state and into new tensors with each of two read paths, interleaved
(ABBA within every rep, the order of the two kinds rotated):

- ``fused``: the POSIX reader's ``read_into_crc`` / ``read_ranges_crc`` (each 256 KiB piece checksummed
  right after its copy out of a bounce buffer, in-place bytes where they landed);
- ``separate``: the engine's read-then-check path that every other backend takes (``read_into`` /
  ``read_ranges``, then the CRC-32C of each chunk over the destination), obtained here by hiding the reader's
  checksumming methods from the engine.

Both run in the same process on the same files, so the comparison is free of the differences between
processes (allocator state, placement). Each restore reports its wall time and the process's CPU time
(``os.times``: user + system, all threads). Run as root for ``drop_caches``; otherwise files are evicted with
``POSIX_FADV_DONTNEED``. Memory: the state, the live copy, the restored copy (3 x ``--size``).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/fused_read.py --dir /tmp/tiersave-fused --size 3 --reps 4
    PYTHONPATH=src .venv/bin/python benchmarks/fused_read.py --storage mem --size 1 --reps 4

With ``--storage mem`` the shards live in a ``mem://`` tier (tmpfs) and reads are buffered: both paths read a
whole chunk, then checksum it (commit 83f6c6b read buffered requests piece by piece, each checksummed right
after it was read; docs/benchmarks.md gives what it measured and why it is not kept).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_stages import prepare

import tiersave.engine.reader as engine_reader
from tiersave import Checkpointer
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage


@runtime_checkable
class _Nobody(Protocol):
    """A protocol no reader implements: the engine then reads and checks in two passes."""

    def _no_reader_has_this(self) -> None: ...


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def copy_out_ms(reps: int = 5) -> tuple[list[float], list[float]]:
    """One thread's copy of 1 GiB out of an 8 MiB bounce buffer into 64 MiB destinations (64 B past a page,
    as a live tensor) with its CRC-32C: ``(separate, fused)`` milliseconds per rep, interleaved. Separate is a
    ``memmove`` per bounce buffer then the CRC of each 64 MiB chunk, fused is :class:`ChecksumSink`."""
    import ctypes

    from tiersave.format.checksum import crc32c_update
    from tiersave.storage.posix.blobs import ChecksumSink
    from tiersave.storage.posix.buffers import address_of, aligned_buffer

    bounce = aligned_buffer(8 << 20)
    bounce[:] = os.urandom(8 << 20)
    dest = aligned_buffer((64 << 20) + 64)[64:]
    separate: list[float] = []
    fused: list[float] = []
    for _ in range(reps):
        for path in ("separate", "fused"):
            t0 = time.perf_counter()
            for _chunk in range(16):  # 16 chunks of 64 MiB
                sink = ChecksumSink()
                for off in range(0, 64 << 20, 8 << 20):
                    piece = dest[off : off + (8 << 20)]
                    if path == "fused":
                        sink.copy(piece, bounce)
                    else:
                        ctypes.memmove(address_of(piece), address_of(bounce), 8 << 20)
                if path == "separate":
                    crc32c_update(0, dest)
            (fused if path == "fused" else separate).append((time.perf_counter() - t0) * 1e3)
    return separate, fused


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the file system to measure (default: a temp dir)")
    p.add_argument("--size", type=float, default=3.0, help="state size in GB")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--no-drop-caches", action="store_true", help="evict with fadvise only (no drop_caches)")
    p.add_argument(
        "--storage",
        default="direct",
        choices=["direct", "mem"],
        help="direct: LocalStorage(--dir, io='direct'), read cold; mem: a mem:// tier (tmpfs, buffered reads)",
    )
    args = p.parse_args()
    from tiersave.bench.device import evict

    _, root, state, live, nbytes = prepare(args.dir, "tiersave-fused-", args.size)
    separate_ms, fused_ms = copy_out_ms()
    print(
        f"copy out of a bounce buffer + CRC-32C, 1 GiB, one thread (median of {len(fused_ms)}, interleaved): "
        f"separate {statistics.median(separate_ms):.0f} ms ({min(separate_ms):.0f}-{max(separate_ms):.0f}), "
        f"fused {statistics.median(fused_ms):.0f} ms ({min(fused_ms):.0f}-{max(fused_ms):.0f})",
        flush=True,
    )
    fused_protocol = engine_reader.ChecksumReader
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    storage = LocalStorage(root, io="direct") if args.storage == "direct" else MemoryStorage(f"fused-{os.getpid()}")
    with Checkpointer(storage, keep_last=1, event_log=False) as ckpt:
        ckpt.save(1, state)
        for rep in range(args.reps):
            kinds = ["into", "new"] if rep % 2 == 0 else ["new", "into"]
            paths = (
                ["fused", "separate", "separate", "fused"]
                if rep % 2 == 0
                else ["separate", "fused", "fused", "separate"]
            )
            for kind in kinds:
                for path in paths:
                    engine_reader.ChecksumReader = fused_protocol if path == "fused" else _Nobody  # type: ignore[misc]
                    if args.storage == "direct":
                        evict([root], drop_caches=not args.no_drop_caches)
                    t0, c0 = time.perf_counter(), _cpu()
                    out = ckpt.restore(1, into=live if kind == "into" else None)
                    wall, cpu = time.perf_counter() - t0, _cpu() - c0
                    results.setdefault((kind, path), []).append((wall, cpu))
                    if rep == 0:
                        assert all(torch.equal(out[k], v) for k, v in state.items())
                    del out
    engine_reader.ChecksumReader = fused_protocol  # type: ignore[misc]
    if isinstance(storage, MemoryStorage):
        storage.destroy()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    n = 2 * args.reps
    print(f"\n| restore | path | wall s (median of {n}, range) | GB/s | CPU s (median, range) |")
    print("| --- | --- | --- | --- | --- |")
    for (kind, path), rows in sorted(results.items()):
        walls, cpus = [w for w, _ in rows], [c for _, c in rows]
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        print(
            f"| {'into the live state' if kind == 'into' else 'new tensors'} | {path} | {wall:.2f} "
            f"({min(walls):.2f}-{max(walls):.2f}) | {nbytes / wall / 1e9:.2f} | "
            f"{cpu:.2f} ({min(cpus):.2f}-{max(cpus):.2f}) |"
        )


if __name__ == "__main__":
    main()
