"""Two processes reading the same two files through one page cache: in the same order, or each starting on its own.

What the replicated restore on the ranks of one machine does to the disk (docs/distributed.md, "Reading it once per
machine"), without tiersave: two files of ``--size`` each (rank r's share of the replicated state), two processes
each reading both into memory with ``--threads`` threads of ``--chunk`` buffered ``pread`` calls, after evicting the
files from the page cache (``POSIX_FADV_DONTNEED``). Orders, interleaved and rotated from rep to rep:

- ``same``: both processes read file 0, then file 1 (every rank in one order; tiersave since 2026-11-24);
- ``own-first``: process r reads file r first, then the other (tiersave's order for large tensors until then);
- ``own-first+willneed``: as ``own-first``, each thread announcing the chunk 4 chunks ahead (``POSIX_FADV_WILLNEED``).

Prints each rep's slowest process and the medians.

Usage::

    python benchmarks/shared_read_order.py --dir /tmp --size 512MiB --reps 6
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ORDERS = ("same", "own-first", "own-first+willneed")


def _process(rank: int, files: list[Path], order: str, threads: int, chunk: int, barrier: object, out: object) -> None:
    paths = files if order == "same" else [files[rank], files[1 - rank]]
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    size = os.fstat(fds[0]).st_size
    buf = mmap.mmap(-1, 2 * size)
    for i in range(0, 2 * size, mmap.PAGESIZE):  # fault the destination in first: a live state's memory is
        buf[i] = 0
    view = memoryview(buf)
    jobs = [(i, off) for i in range(2) for off in range(0, size, chunk)]
    ahead = order.endswith("+willneed")

    def read(job: tuple[int, int]) -> None:
        i, off = job
        n = min(chunk, size - off)
        if ahead and off + 4 * chunk < size:
            os.posix_fadvise(fds[i], off + 4 * chunk, chunk, os.POSIX_FADV_WILLNEED)
        dest, got = view[i * size + off : i * size + off + n], 0
        while got < n:
            got += os.preadv(fds[i], [dest[got:]], off + got)

    barrier.wait()  # type: ignore[attr-defined]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, jobs))
    out.put(time.perf_counter() - start)  # type: ignore[attr-defined]
    for fd in fds:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="where the two files go (default: a new temporary directory)")
    p.add_argument("--size", default="512MiB", help="bytes per file (KiB/MiB/GiB suffixes)")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--chunk", default="64MiB")
    p.add_argument("--reps", type=int, default=6)
    args = p.parse_args(argv)
    from tiersave.bench.device import evict
    from tiersave.units import parse_bytes

    size, chunk = parse_bytes(args.size), parse_bytes(args.chunk)
    work = Path(tempfile.mkdtemp(prefix="shared-read-order-", dir=args.dir))
    files = [work / f"share-{r}.bin" for r in range(2)]
    try:
        block = os.urandom(1 << 20)
        for path in files:
            with open(path, "wb") as f:
                for _ in range(0, size, len(block)):
                    f.write(block)
        print(
            f"2 processes x {args.threads} threads, 2 files of {size / 2**20:.0f} MiB, {chunk >> 20} MiB reads; "
            f"load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        times: dict[str, list[float]] = {o: [] for o in ORDERS}
        ctx = mp.get_context("spawn")
        for rep in range(args.reps):
            k = rep % len(ORDERS)
            for order in ORDERS[k:] + ORDERS[:k]:
                evict(files, drop_caches=False)
                barrier, out = ctx.Barrier(2), ctx.Queue()
                procs = [
                    ctx.Process(target=_process, args=(r, files, order, args.threads, chunk, barrier, out))
                    for r in range(2)
                ]
                for proc in procs:
                    proc.start()
                slowest = max(out.get(timeout=600) for _ in procs)
                for proc in procs:
                    proc.join(timeout=60)
                times[order].append(slowest)
                print(f"rep {rep} {order}: {slowest:.3f} s ({2 * size / slowest / 1e9:.2f} GB/s)", flush=True)
        print(f"medians over {args.reps} reps (slowest process); load average {os.getloadavg()[0]:.1f} at the end")
        for order, ts in times.items():
            print(f"  {order:20s} {statistics.median(ts):.3f} s  (each: {' '.join(f'{t:.3f}' for t in ts)})")
    finally:
        for path in files:
            path.unlink(missing_ok=True)
        work.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
