"""Direct writes of the same bytes in small and large requests: what the device gives each, no tiersave.

An MoE-like save writes one 4 MiB unit per expert where a few large tensors are written in 64 MiB units;
this measures whether the device itself serves 4 MiB ``O_DIRECT`` writes slower than 64 MiB ones. One
preallocated file of ``--mb`` MiB in ``--dir`` is written from four threads (as tiersave's writers) in
requests of each size, then ``fsync``-ed; the sizes alternate in order, medians of ``--reps``.

Usage::

    .venv/bin/python benchmarks/direct_write_sizes.py --dir DIR --mb 1024 --reps 5
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a directory on the disk to measure")
    p.add_argument("--mb", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64])
    args = p.parse_args()
    n = args.mb << 20
    buf = mmap.mmap(-1, n)  # page-aligned, as the staging arena
    buf.write(os.urandom(1 << 20) * args.mb)
    view = memoryview(buf)
    pool = ThreadPoolExecutor(4)

    def run(unit: int) -> float:
        path = Path(args.dir) / f"direct-write-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            os.posix_fallocate(fd, 0, n)  # as tiersave's writer: overwrites in place
            t0 = time.perf_counter()
            list(pool.map(lambda off: os.pwrite(fd, view[off : off + unit], off), range(0, n, unit)))
            os.fsync(fd)
            return time.perf_counter() - t0
        finally:
            os.close(fd)
            path.unlink()

    times: dict[int, list[float]] = {s: [] for s in args.sizes_mib}
    load = os.getloadavg()[0]
    for rep in range(args.reps):
        order = args.sizes_mib if rep % 2 == 0 else args.sizes_mib[::-1]
        for size in order:
            times[size].append(run(size << 20))
    pool.shutdown()
    print(f"{args.mb} MiB, 4 threads, O_DIRECT; load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for size, v in times.items():
        med = statistics.median(v)
        spread = f"{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}"
        print(f"| {size} MiB requests | {med * 1e3:.0f} ms | {spread} | {n / med / 1e9:.2f} GB/s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
