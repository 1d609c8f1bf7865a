"""The staging copy and its CRC-32C: two passes (copy the bytes, then read them back for the checksum) against
one (``HostCopier.copy_checksum``: each 256 KiB piece checksummed right after its copy, while it is in cache).

Prints, per round, the seconds each way takes over ``--gib`` GiB in 64 MiB units (a save's checksum chunks),
on one thread and split over the copier's threads, optionally with ``--contenders`` Python threads that take
the GIL between short sleeps (as writer threads do between their system calls)::

    PYTHONPATH=src .venv/bin/python benchmarks/copy_checksum.py --gib 1 --rounds 3 --contenders 4

A save runs the fused way on its caller's thread (engine/pipeline.py); the two-pass way is what it did before.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time

import torch

from tiersave.engine.stage import HostCopier
from tiersave.format.checksum import crc32c_update

UNIT = 64 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="bytes copied per round, in GiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--contenders", type=int, default=0, help="GIL-taking threads running beside the copy")
    args = p.parse_args()
    n = int(args.gib * (1 << 30)) // UNIT * UNIT
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    view, dst_ptr, src_ptr = dst.numpy().data.cast("B"), dst.data_ptr(), src.data_ptr()
    single, split = HostCopier(threads=1), HostCopier()
    stop = threading.Event()

    def contend() -> None:
        x = 0
        while not stop.is_set():
            for i in range(200):
                x += i
            time.sleep(0.0002)

    threads = [threading.Thread(target=contend, daemon=True) for _ in range(args.contenders)]
    for t in threads:
        t.start()

    def two_passes(copier: HostCopier) -> None:
        for off in range(0, n, UNIT):
            copier.copy(dst_ptr + off, src_ptr + off, UNIT)
            crc32c_update(0, view[off : off + UNIT])

    def fused(copier: HostCopier) -> None:
        for off in range(0, n, UNIT):
            copier.copy_checksum(view, dst_ptr, off, src_ptr + off, UNIT)

    ways = {
        "two passes, 1 thread": lambda: two_passes(single),
        "fused, 1 thread": lambda: fused(single),
        f"two passes, {split.threads} threads": lambda: two_passes(split),
        f"fused, {split.threads} threads": lambda: fused(split),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    try:
        ctypes.memmove(dst_ptr, src_ptr, n)  # touch the destination once: no first-touch faults in the rounds
        for r in range(args.rounds):
            names = list(ways)
            names = names[r % len(names) :] + names[: r % len(names)]  # rotated: no way always runs first
            for name in names:
                start = time.perf_counter()
                ways[name]()
                times[name].append(time.perf_counter() - start)
    finally:
        stop.set()
        for t in threads:
            t.join()
        single.close()
        split.close()
    gib = n / (1 << 30)
    for name, values in times.items():
        per_gib = sorted(v * 1000 / gib for v in values)
        print(
            f"{name:24s} median {statistics.median(per_gib):7.1f} ms per GiB (range {per_gib[0]:.1f}-{per_gib[-1]:.1f})"
        )


if __name__ == "__main__":
    main()
