"""Object-store tier throughput vs the raw multipart throughput of the same client on the same server.

Starts a throwaway SeaweedFS (``weed mini``) on loopback and, in one run, interleaving repetitions:

Uploads, then downloads, alternate in ABBA order across repetitions (raw first, then tier first, ...),
so the server's background work after an upload does not always fall on the same contender.

- raw upload: ``obstore.put`` of the whole buffer as one multipart upload (part size and concurrency as
  the tier's), on the tier's own ``S3Store``;
- raw download: ranged ``obstore.get_range`` of part-sized pieces from a thread pool into one buffer;
- tier upload: ``S3Storage.open_writer`` + ``write_at`` of 64 MiB chunks from 8 threads (what the writer
  engine does) + ``finish``;
- tier download: ``S3BlobReader.read_into`` of 64 MiB chunks from 8 threads (what the reader engine does);
- drain: ``copy_checkpoint`` of a checkpoint of the same size from the memory tier to S3 and back
  (CRC-32C of every chunk, commit protocol; back = download + verify).

Prints medians and the ratios tier/raw (target >= 0.8) and writes JSON with ``--json PATH``.

    .venv/bin/python benchmarks/s3_throughput.py --size 512MiB --reps 3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import obstore

from tiersave.catalog import Catalog
from tiersave.drain import copy_checkpoint
from tiersave.format.checksum import chunk_ranges, crc32c_hex
from tiersave.format.layout import shard_filename, step_dirname
from tiersave.format.manifest import Manifest, ShardInfo, TensorEntry
from tiersave.storage.memory import MemoryStorage
from tiersave.testing.seaweed import SeaweedServer
from tiersave.units import parse_bytes

CHUNK = 64 << 20


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_mem_checkpoint(mem: MemoryStorage, data: memoryview, step: int) -> None:
    """A one-tensor checkpoint in the memory tier, written directly (no torch needed)."""
    n = len(data)
    crcs = tuple(crc32c_hex(data[o : o + ln]) for o, ln in chunk_ranges(n, CHUNK))
    prefix = f"{step_dirname(step)}.tmp-bench"
    writer = mem.open_writer(f"{prefix}/{shard_filename(0, 0)}")
    writer.write_at(0, data)
    writer.finish(n)
    entry = TensorEntry("w", "uint8", (n,), 0, 0, n, crcs)
    manifest = Manifest(
        step=step,
        shards=(ShardInfo(shard_filename(0, 0), 0, n),),
        tensors={"w": entry},
        tree={"$ndarray": "w"},
        chunk_bytes=CHUNK,
    )
    mem.put(f"{prefix}/manifest.json", manifest.to_json(), mode="create")
    mem.rename_prefix(prefix, step_dirname(step))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="512MiB", help="bytes per transfer (a multiple of 4096)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement (median reported)")
    parser.add_argument("--part-size", default="16MiB")
    parser.add_argument("--concurrency", type=int, default=8, help="parts in flight / parallel GETs")
    parser.add_argument("--threads", type=int, default=8, help="threads calling write_at / read_into")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    size = parse_bytes(args.size) // 4096 * 4096
    part = parse_bytes(args.part_size)

    print(f"generating {size >> 20} MiB of random data...", file=sys.stderr)
    data = memoryview(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    out = bytearray(size)
    outv = memoryview(out)
    base = Path(tempfile.mkdtemp(prefix="tiersave-bench-weed-"))
    server = SeaweedServer(base / "data")
    server.start()
    mem = MemoryStorage(f"bench-{uuid.uuid4().hex[:8]}")
    results: dict[str, list[float]] = {
        k: [] for k in ("raw_up", "tier_up", "raw_down", "tier_down", "drain_up", "drain_down")
    }
    try:
        opts = {
            "part_size": args.part_size,
            "upload_concurrency": args.concurrency,
            "read_part_size": args.part_size,
            "read_concurrency": args.concurrency,
        }
        s3 = server.storage("bench", "tier", **opts)
        store = s3._store  # the very client the tier uses
        obstore.put(store, "warmup", data[: 32 << 20], use_multipart=True, chunk_size=part)
        make_mem_checkpoint(mem, data, 1)
        pool = ThreadPoolExecutor(max(args.threads, args.concurrency))

        def raw_up() -> None:
            obstore.put(store, "raw/obj", data, use_multipart=True, chunk_size=part, max_concurrency=args.concurrency)

        def raw_down() -> None:
            def piece(o: int) -> None:
                got = obstore.get_range(store, "raw/obj", start=o, length=min(part, size - o))
                outv[o : o + len(got)] = memoryview(got)

            list(pool.map(piece, range(0, size, part)))

        def tier_up(rep: int) -> None:
            key = f"tier/obj-{rep}"
            writer = s3.open_writer(key)
            list(pool.map(lambda o: writer.write_at(o, data[o : o + CHUNK]), range(0, size, CHUNK)))
            writer.finish(size)

        def tier_down(rep: int) -> None:
            reader = s3.open_reader(f"tier/obj-{rep}")
            list(pool.map(lambda o: reader.read_into(o, outv[o : o + CHUNK]), range(0, size, CHUNK)))

        def drain_up(rep: int) -> None:
            dst = server.storage("bench", f"drain-{rep}", **opts)
            copy_checkpoint(mem, dst, 1, io_threads=args.threads)

        def drain_down(rep: int) -> None:
            src = server.storage("bench", f"drain-{rep}", **opts)
            back = MemoryStorage(f"{mem.name}-back-{rep}")
            try:
                copy_checkpoint(src, back, 1, io_threads=args.threads)
            finally:
                back.destroy()

        for rep in range(args.reps):
            # ABBA order: the server's background work after one upload (flushes) must not always land on
            # the same contender.
            ups = [("raw_up", raw_up), ("tier_up", functools.partial(tier_up, rep))]
            downs = [("raw_down", raw_down), ("tier_down", functools.partial(tier_down, rep))]
            drains = [
                ("drain_up", functools.partial(drain_up, rep)),
                ("drain_down", functools.partial(drain_down, rep)),
            ]
            for group in (ups, downs):
                for name, fn in group if rep % 2 == 0 else reversed(group):
                    outv[:4096] = bytes(4096)
                    results[name].append(timed(fn))
                    if name == "raw_down" and bytes(outv[:4096]) != bytes(data[:4096]):
                        raise SystemExit("raw download returned wrong bytes")
                    if name == "tier_down" and out != data:
                        raise SystemExit("tier download returned wrong bytes")
            for name, fn in drains:
                results[name].append(timed(fn))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
        if not Catalog(server.storage("bench", "drain-0", **opts)).verify(1).ok:
            raise SystemExit("drained checkpoint does not verify")
        pool.shutdown()
    finally:
        mem.destroy()
        server.kill()
        shutil.rmtree(base, ignore_errors=True)

    def mbps(key: str) -> float:
        return size / statistics.median(results[key]) / 1e6

    load = os.getloadavg()[0]

    rows = [
        ("upload", mbps("raw_up"), mbps("tier_up"), mbps("drain_up")),
        ("download", mbps("raw_down"), mbps("tier_down"), mbps("drain_down")),
    ]
    print(
        f"\nSeaweedFS {server.weed} on loopback, {size >> 20} MiB, part {part >> 20} MiB, concurrency "
        f"{args.concurrency}, {args.threads} caller threads, median of {args.reps}, {os.cpu_count()} CPUs, "
        f"load average {load:.1f}"
    )
    print(f"{'':10}{'raw MB/s':>10}{'tier MB/s':>11}{'tier/raw':>10}{'drain MB/s':>12}{'drain/raw':>11}")
    for name, raw, tier, drain in rows:
        print(f"{name:10}{raw:10.0f}{tier:11.0f}{tier / raw:10.2f}{drain:12.0f}{drain / raw:11.2f}")
    doc = {
        "size_bytes": size,
        "part_bytes": part,
        "concurrency": args.concurrency,
        "threads": args.threads,
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "load_average": load,
        "python": platform.python_version(),
        "obstore": obstore.__version__,
        "seconds": results,
        "mb_per_s": {k: size / statistics.median(v) / 1e6 for k, v in results.items()},
        "ratios": {
            "upload_tier_over_raw": rows[0][2] / rows[0][1],
            "download_tier_over_raw": rows[1][2] / rows[1][1],
            "upload_drain_over_raw": rows[0][3] / rows[0][1],
            "download_drain_over_raw": rows[1][3] / rows[1][1],
        },
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
