"""The hash functions an incremental save could give its pieces, side by side: CPU time per byte (immune to
other processes on a shared machine, unlike wall time) and wall-clock throughput with 1 and 2 threads, over
pieces of ``--piece-mb`` (an incremental save hashes one checksum chunk or group of small tensors at a time),
CRC-32C alongside as the floor every save already pays. Functions interleaved in each rep, medians of
``--reps``.

Usage::

    .venv/bin/python benchmarks/content_hash.py --mb 256 --piece-mb 16 --reps 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tiersave.format.checksum import crc32c_update

MiB = 1 << 20


def functions() -> dict[str, Callable[[memoryview], object]]:
    out: dict[str, Callable[[memoryview], object]] = {
        "sha256": lambda b: hashlib.sha256(b).hexdigest(),
        "blake2b": lambda b: hashlib.blake2b(b, digest_size=32).hexdigest(),
        "crc32c": lambda b: crc32c_update(0, b),
    }
    try:
        import blake3
    except ImportError:
        print("blake3 is not installed: not measured")
    else:
        out["blake3"] = lambda b: blake3.blake3(b).hexdigest()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256)
    p.add_argument("--piece-mb", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    data = memoryview(bytearray(os.urandom(args.mb * MiB)))
    step = args.piece_mb * MiB
    pieces = [data[i : i + step] for i in range(0, len(data), step)]
    fns = functions()
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    wall1: dict[str, list[float]] = {n: [] for n in fns}
    wall2: dict[str, list[float]] = {n: [] for n in fns}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(args.reps):
            for name, fn in fns.items():
                t, c = time.perf_counter(), time.thread_time()
                for piece in pieces:
                    fn(piece)
                cpu[name].append(len(data) / (time.thread_time() - c) / 1e9)
                wall1[name].append(len(data) / (time.perf_counter() - t) / 1e9)
                t = time.perf_counter()
                list(pool.map(fn, pieces))
                wall2[name].append(len(data) / (time.perf_counter() - t) / 1e9)
    result = {
        name: {
            "cpu_gb_s": statistics.median(cpu[name]),
            "wall_1_thread_gb_s": statistics.median(wall1[name]),
            "wall_2_threads_gb_s": statistics.median(wall2[name]),
        }
        for name in fns
    }
    print(f"{args.mb} MiB in {args.piece_mb} MiB pieces, medians of {args.reps}; GB/s")
    print(f"{'function':<10} {'per CPU second':>15} {'wall, 1 thread':>15} {'wall, 2 threads':>16}")
    for name, r in result.items():
        print(f"{name:<10} {r['cpu_gb_s']:>15.2f} {r['wall_1_thread_gb_s']:>15.2f} {r['wall_2_threads_gb_s']:>16.2f}")
    load = os.getloadavg()
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in load)}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "load": load, "result": result}) + "\n")


if __name__ == "__main__":
    main()
