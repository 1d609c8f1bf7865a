"""The raw limit behind the MoE restore: the same bytes read from one file as many medium requests, as a few
large ones, and as medium buffers gathered into one vectored request (``preadv``), all direct (O_DIRECT),
from a pool of threads as tiersave's restore uses. No checksums, no tiersave code: what the device gives.

Usage::

    .venv/bin/python benchmarks/vectored_reads.py --dir DIR --mib 1536 --runs 3

Methods (interleaved run by run, medians of ``--runs``): ``4MiB``: one ``preadv`` of 4 MiB per request (an
MoE expert per request, as before issue 15's vectored runs); ``64MiB``: one 64 MiB request (a large tensor's
chunk); ``4MiBx16``: sixteen 4 MiB buffers in one ``preadv`` (a run of experts, as restore reads them now).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

_METHODS = {"4MiB": (4 << 20, 1), "64MiB": (64 << 20, 1), "4MiBx16": (4 << 20, 16)}


def read_all(fd: int, mv: memoryview, size: int, piece: int, per_call: int, threads: int) -> float:
    """Seconds to read ``size`` bytes in calls of ``per_call`` buffers of ``piece`` bytes each."""
    step = piece * per_call
    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        futures = [
            ex.submit(os.preadv, fd, [mv[o + i * piece : o + (i + 1) * piece] for i in range(per_call)], o)
            for o in range(0, size, step)
        ]
        for f in futures:
            if f.result() != step:
                raise RuntimeError("short read")
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="a directory on the disk to measure (default: a temporary one)")
    p.add_argument("--mib", type=int, default=1536, help="file size in MiB (a multiple of 64)")
    p.add_argument("--threads", type=int, default=min(8, max(2, 2 * (os.cpu_count() or 1))))
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    size = (args.mib // 64) * (64 << 20)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "data.bin")
        with open(path, "wb") as f:
            block = os.urandom(64 << 20)
            for _ in range(size // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        buf = mmap.mmap(-1, size)  # page-aligned: every buffer is read in place
        mv = memoryview(buf)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            samples: dict[str, list[float]] = {m: [] for m in _METHODS}
            for _ in range(args.runs):
                for method, (piece, per_call) in _METHODS.items():
                    samples[method].append(read_all(fd, mv, size, piece, per_call, args.threads))
        finally:
            os.close(fd)
            mv.release()
            buf.close()
    print(f"{size >> 20} MiB, {args.threads} threads, medians of {args.runs} interleaved runs, load {os.getloadavg()}")
    for method, xs in samples.items():
        med = statistics.median(xs)
        print(f"{method:>8}: {med:.3f} s, {size / med / 1e9:.2f} GB/s (runs {', '.join(f'{x:.3f}' for x in xs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
