#!/usr/bin/env python3
"""Storage-layer microbenchmark: each I/O path of LocalStorage against the raw device, side by side.

What it answers (issue 3): does the direct path reach the device's raw bandwidth, and for memory that is
not page-aligned (torch tensors sit 64 bytes past a page boundary), is a bounce buffer or the buffered
path faster? It writes and reads one shard of ``--size`` bytes in 64 MiB units from ``--threads``
threads (the engine's pattern), per path:

- write: direct from aligned memory (in place), direct from unaligned memory (bounce buffers), buffered;
  each followed by ``finish`` (fsync);
- read, cold cache: direct into aligned memory (in place), direct into unaligned memory (bounce),
  buffered into unaligned memory;

next to raw large-block direct I/O of the same bytes (tiersave.bench.device). Rounds rotate the order.
No torch, no checksums: the storage layer alone.

Usage: .venv/bin/python benchmarks/io_paths.py DIR [--size 2GB] [--rounds 3] [--threads 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tiersave.bench.device import evict, measure_raw
from tiersave.storage.posix import LocalStorage
from tiersave.storage.posix.buffers import aligned_buffer
from tiersave.units import parse_bytes

UNIT = 64 << 20


def unaligned(n: int) -> memoryview:
    return aligned_buffer(n + 64)[64 : 64 + n]


def write(root: Path, mode: str, src: memoryview, threads: int) -> float:
    storage = LocalStorage(root, io=mode)
    n = len(src)
    start = time.perf_counter()
    writer = storage.open_writer("shard")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda o: writer.write_at(o, src[o : o + UNIT]), range(0, n, UNIT)))
    writer.finish(n)
    return n / (time.perf_counter() - start) / 1e9


def read(root: Path, mode: str, dst: memoryview, threads: int) -> float:
    storage = LocalStorage(root, io=mode, min_direct_bytes=0)
    evict([root / "shard"])
    n = len(dst)
    start = time.perf_counter()
    with storage.open_reader("shard") as reader, ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda o: reader.read_into(o, dst[o : o + UNIT]), range(0, n, UNIT)))
    return n / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--size", default="2GB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)
    n = parse_bytes(args.size) // UNIT * UNIT
    root = args.directory.resolve() / "io-paths"
    root.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    src_aligned, src_unaligned = aligned_buffer(n), unaligned(n)
    src_aligned[:] = data.data
    src_unaligned[:] = data.data
    dst_aligned, dst_unaligned = aligned_buffer(n), unaligned(n)
    dst_aligned[:] = data.data  # touched, as a live state is
    dst_unaligned[:] = data.data
    cases = {
        "write direct, aligned source (in place)": lambda: write(root, "direct", src_aligned, args.threads),
        "write direct, unaligned source (bounce)": lambda: write(root, "direct", src_unaligned, args.threads),
        "write buffered (+fsync)": lambda: write(root, "buffered", src_unaligned, args.threads),
        "read direct, aligned destination (in place)": lambda: read(root, "direct", dst_aligned, args.threads),
        "read direct, unaligned destination (bounce)": lambda: read(root, "direct", dst_unaligned, args.threads),
        "read buffered, unaligned destination": lambda: read(root, "buffered", dst_unaligned, args.threads),
    }
    results: dict[str, list[float]] = {name: [] for name in cases}
    raw_w: list[float] = []
    raw_r: list[float] = []
    load = [os.getloadavg()]
    for rnd in range(args.rounds):
        names = list(cases)
        k = rnd % len(names)
        raw = measure_raw(root, n)
        raw_w.append(raw.best_write)
        raw_r.append(raw.best_read)
        for name in names[k:] + names[:k]:
            if name.startswith("read") and not (root / "shard").exists():
                write(root, "direct", src_aligned, args.threads)
            if name.startswith("write"):
                (root / "shard").unlink(missing_ok=True)
            results[name].append(cases[name]())
            print(f"round {rnd + 1}: {name}: {results[name][-1]:.2f} GB/s", file=sys.stderr)
    load.append(os.getloadavg())
    shutil.rmtree(root, ignore_errors=True)
    raw_write, raw_read = statistics.median(raw_w), statistics.median(raw_r)
    print(f"{n / 1e9:.2f} GB, {args.threads} threads, {args.rounds} rounds (median), load {load[0]} -> {load[1]}")
    print(f"raw direct write {raw_write:.2f} GB/s, best raw read {raw_read:.2f} GB/s")
    rows = {}
    for name, values in results.items():
        med = statistics.median(values)
        ref = raw_write if name.startswith("write") else raw_read
        rows[name] = {"gbps": values, "median_gbps": med, "vs_raw": med / ref}
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name:45s} {med:5.2f} GB/s  {med / ref:4.2f}x raw   (rounds: {each})")
    if args.json_out:
        doc = {"bytes": n, "threads": args.threads, "raw_write": raw_w, "raw_read": raw_r, "cases": rows, "load": load}
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
