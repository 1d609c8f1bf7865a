#!/usr/bin/env python3
"""DCP save and load through tiersave.dcp.Writer/Reader against DCP's own FileSystemWriter/Reader.

Same state, same disk, same process group, in one run: N ranks (gloo on 127.0.0.1) each hold
``--size / N`` bytes of float32 tensors under their own names (as FSDP shards are), and every repeat
saves and loads that state with each method, in rotating order. A save is timed from a barrier before
``dcp.save`` to a barrier after it (so the slowest rank's time, commit included); a load likewise, from a
cold page cache (every file of the checkpoint is fsynced and evicted with posix_fadvise(DONTNEED) first).
The first repeat checks that the loaded tensors equal the saved ones. Reported: the median of the
repeats per method, and the ratio DCP time / tiersave time (above 1: tiersave is faster).

Methods: ``tiersave`` (Writer/Reader, defaults: 4 I/O threads, direct I/O where the file system allows);
``fs`` (FileSystemWriter/Reader with DCP's defaults: one writer thread, fsync on); ``fs-t4``
(FileSystemWriter with thread_count=4).

Usage: .venv/bin/python benchmarks/dcp_vs_fs.py [--dir DIR] [--size 500MB] [--ranks 1 2] [--repeats 3]
       [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from tiersave.bench.device import evict

METHODS = ("tiersave", "fs", "fs-t4")
TENSORS_PER_RANK = 24


def writer(method: str, base: Path, step: int) -> Any:
    if method == "tiersave":
        from tiersave.dcp import Writer

        return Writer(base / "tiersave", step=step)
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(base / method / f"step-{step}", thread_count=4 if method == "fs-t4" else 1)


def reader(method: str, base: Path, step: int) -> Any:
    if method == "tiersave":
        from tiersave.dcp import Reader

        return Reader(base / "tiersave", step=step)
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(base / method / f"step-{step}")


def timed(fn: Any) -> float:
    """Seconds from a barrier before ``fn`` to a barrier after it, the slowest rank's view."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    base = Path(args.dir)
    per_tensor = args.size // world // TENSORS_PER_RANK // 4
    gen = torch.Generator().manual_seed(rank)
    state = {f"rank{rank}.t{i}": torch.rand(per_tensor, generator=gen) for i in range(TENSORS_PER_RANK)}
    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in METHODS}
    for rep in range(args.repeats):
        order = METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]
        for method in order:
            step = rep + 1
            w = writer(method, base, step)
            times[method]["save"].append(timed(lambda w=w: dcp.save(state, storage_writer=w)))
            if rank == 0:
                evict([base / method], drop_caches=False)  # fadvise, as before: no root needed
            dest = {k: torch.zeros_like(v) for k, v in state.items()}
            r = reader(method, base, step)
            times[method]["load"].append(timed(lambda r=r, dest=dest: dcp.load(dest, storage_reader=r)))
            if rep == 0 and not all(torch.equal(dest[k], v) for k, v in state.items()):
                raise SystemExit(f"{method}: loaded tensors differ from the saved ones")
            dist.barrier()
            if rank == 0:
                shutil.rmtree(base / method, ignore_errors=True)
            dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_size(text: str) -> int:
    units = {"GB": 10**9, "MB": 10**6, "GIB": 1 << 30, "MIB": 1 << 20}
    for suffix, mult in units.items():
        if text.upper().endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory in /tmp)")
    parser.add_argument("--size", type=parse_size, default=parse_size("500MB"), help="total state bytes")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.dir = tempfile.mkdtemp(prefix="dcp-vs-fs-", dir=args.dir)
    results: dict[str, Any] = {"size_bytes": args.size, "repeats": args.repeats, "dir": args.dir, "ranks": {}}
    try:
        for world in args.ranks:
            out = os.path.join(args.dir, f"times-{world}.json")
            mp.start_processes(run_rank, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
            results["ranks"][str(world)] = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"state {args.size / 1e6:.0f} MB in total, median of {args.repeats}, slowest rank, cold-cache loads")
    print(f"{'ranks':>5}  {'op':<5}" + "".join(f"{m:>12}" for m in METHODS) + "   fs/tiersave  fs-t4/tiersave")
    for world, times in results["ranks"].items():
        for op in ("save", "load"):
            med = {m: statistics.median(times[m][op]) for m in METHODS}
            cells = "".join(f"{med[m]:>11.2f}s" for m in METHODS)
            ratios = f"{med['fs'] / med['tiersave']:>10.2f}x  {med['fs-t4'] / med['tiersave']:>13.2f}x"
            print(f"{world:>5}  {op:<5}{cells}   {ratios}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
