"""What a read out of tmpfs can reach on this host: ``pread`` and ``mmap`` against ``memcpy``, no tiersave.

The memory tier keeps its files on a tmpfs; any restore from it copies their bytes out. This measures, on
one file of ``--mb`` MiB in ``--dir`` (a tmpfs: ``/dev/shm``, or one mounted with ``huge=within_size``),
interleaved over ``--reps`` reps (medians and ranges):

- ``memcpy``: ``memcpy(3)`` of the same bytes between two touched buffers (glibc streams large copies);
- ``pread``: one ``preadv`` of the whole file into a touched buffer (the kernel's copy, 4 KiB at a time);
- ``pread + crc``: the same in 1 MiB pieces, each CRC-32C-checked right after it lands (still in cache);
- ``mmap``: map the file (``MAP_POPULATE``) and ``memcpy`` out of the mapping; ``map only`` is the
  mapping's own cost (page-table entries: one per 4 KiB page on an ordinary tmpfs, one per 2 MiB on a
  huge-page one).

Usage::

    .venv/bin/python benchmarks/tmpfs_read.py --dir /dev/shm --mb 1024 --reps 5
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--mb", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    n = args.mb << 20
    path = Path(args.dir) / f"tmpfs-read-{uuid.uuid4().hex[:8]}"
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    dst = np.ones(n, dtype=np.uint8)  # touched: preallocated memory
    view = memoryview(dst)
    path.write_bytes(src.data)
    fd = os.open(path, os.O_RDONLY)

    def memcpy() -> None:
        ctypes.memmove(dst.ctypes.data, src.ctypes.data, n)

    def pread() -> None:
        os.preadv(fd, [view], 0)

    def pread_crc() -> None:
        piece = 1 << 20
        for off in range(0, n, piece):
            part = view[off : off + piece]
            os.preadv(fd, [part], off)
            crc32c.crc32c(part)

    def mapped() -> None:
        m = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ)
        arr = np.frombuffer(m, dtype=np.uint8)
        ctypes.memmove(dst.ctypes.data, arr.ctypes.data, n)
        del arr
        m.close()

    def map_only() -> None:
        mmap.mmap(fd, n, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=mmap.PROT_READ).close()

    methods: dict[str, Callable[[], None]] = {
        "memcpy": memcpy,
        "pread": pread,
        "pread + crc": pread_crc,
        "mmap": mapped,
        "map only": map_only,
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    load = os.getloadavg()[0]
    meminfo = Path("/proc/meminfo")
    try:
        for fn in methods.values():
            fn()  # warm-up
        # while the file exists: how much of tmpfs is in huge pages (the file's share, on a quiet host)
        shmem_huge = [ln for ln in meminfo.read_text().splitlines() if ln.startswith("ShmemHugePages")]
        names = list(methods)
        for rep in range(args.reps):
            for k in names[rep % len(names) :] + names[: rep % len(names)]:
                t0 = time.perf_counter()
                methods[k]()
                times[k].append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    print(f"{args.mb} MiB in {args.dir}; load average {load:.2f} -> {os.getloadavg()[0]:.2f}; {shmem_huge}")
    ref = statistics.median(times["memcpy"])
    for k, v in times.items():
        med = statistics.median(v)
        print(f"| {k} | {med * 1e3:.0f} ms | {min(v) * 1e3:.0f}-{max(v) * 1e3:.0f} | {n / med / 1e9:.2f} GB/s | "
              f"{ref / med:.2f}x memcpy |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
