"""Where a replicated restore on several ranks spends its time, next to DCP's load of the same state.

Each of ``--ranks`` processes (gloo on 127.0.0.1) holds the same GPT-like state of ``--size`` bytes (``tiersave
bench``'s), declared ``replicated=["model"]``; the job saves it once with tiersave and once with DCP's
``FileSystemWriter``, then restores both ``--reps`` times, alternating, into the live state (as ``tiersave bench
--ranks N --replicated`` does), after evicting the files from the page cache (``POSIX_FADV_DONTNEED``, as the
bench's ``--no-drop-caches``); tiersave's restore runs twice, with the checks of the replicated state split among
the ranks of the machine (``tiersave``, the default) and with every rank checking everything
(``tiersave-checks-all``, ``TIERSAVE_SPLIT_VERIFY=0``), in an order rotated from rep to rep. Per rank and
restore it prints the wall time and where it went, summed over the
I/O threads: inside the read system calls (``read_into``/``read_ranges`` of the shard readers, wall time), in the
CRC-32C checks (wall and thread CPU time), the rest of the reader's jobs, and, with ``--profile``, the top
functions of the caller's thread under cProfile for both restores. ``--variants`` picks the tiersave restores
timed beside the default one: ``checks-all`` (above), ``rotated`` (each rank reads the replicated tensors that
its rank wrote first, the order before 2026-11-24), ``runs=MIB`` (runs of tensors smaller than a chunk read in
at most MIB MiB each); ``--chunk`` the checksum chunk, which decides which tensors are read chunk by chunk in the
order of the rank's view and which in runs by file. At the end rank 0 prints, per method, the slowest rank's
time of each rep, their median, and the median of DCP's time over the method's in the same rep.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/ranks_restore.py --ranks 2 --size 1GB --reps 3 [--profile]
    PYTHONPATH=src .venv/bin/python benchmarks/ranks_restore.py --reps 8 --variants rotated --chunk 2MiB
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class _Timers:
    """Wall and thread-CPU seconds spent in wrapped functions, summed over every thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dw, dc = time.perf_counter() - w, time.thread_time() - c
                with self.lock:
                    self.wall[name] = self.wall.get(name, 0.0) + dw
                    self.cpu[name] = self.cpu.get(name, 0.0) + dc

        return timed

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()


def _rank(
    rank: int,
    world: int,
    root: str,
    size: int,
    reps: int,
    port: int,
    profile: bool,
    variants: list[str],
    chunk: int | None,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    import tiersave
    from tiersave import restore as restore_module
    from tiersave.bench.device import evict
    from tiersave.bench.workload import build_state, gpt_like_spec
    from tiersave.engine import reader as engine_reader
    from tiersave.storage.posix import blobs

    timers = _Timers()
    engine_reader.crc32c_hex = timers.wrap("crc", engine_reader.crc32c_hex)  # type: ignore[assignment]
    for method in ("read_into", "read_ranges"):
        setattr(blobs.LocalBlobReader, method, timers.wrap("read syscalls", getattr(blobs.LocalBlobReader, method)))
    for job in ("_read_chunk", "_read_run", "_read_group"):
        setattr(engine_reader, job, timers.wrap("reader jobs", getattr(engine_reader, job)))

    state = {"model": build_state(gpt_like_spec("llama3-8b", size), seed=0)}
    nbytes = sum(t.nbytes for t in state["model"].values())
    base = Path(root)
    with tiersave.Checkpointer(
        base / "tiersave", keep_last=2, event_log=False, handle_sigterm=False, chunk_bytes=chunk
    ) as ckpt:
        ckpt.save(1, state, replicated=["model"])
        state_dict_saver.save(state, storage_writer=FileSystemWriter(base / "dcp"))

        def cold() -> None:
            dist.barrier()
            if rank == 0:
                evict([base], drop_caches=False)
            dist.barrier()

        def timed(name: str, fn: Callable[[], Any]) -> tuple[float, str]:
            cold()
            prof = cProfile.Profile() if profile else None
            timers.reset()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            if prof is not None:
                prof.enable()
            fn()
            if prof is not None:
                prof.disable()
            seconds = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            timers.wall["process cpu"] = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
            text = ""
            if prof is not None:
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(8)
                text = "\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip())
            return seconds, text

        run_bytes = engine_reader.RUN_READ_BYTES
        same_order = restore_module.rank_view

        def rotated(manifest: Any, r: int | None, world_size: int) -> Any:
            """The read order before 2026-11-24: rank r starts with the tensors rank r wrote, then r+1's..."""
            view = same_order(manifest, r, world_size)
            items = list(view.tensors.items())
            own = [(n, t) for n, t in items if not n.startswith("replicated/")]
            shared = [(n, t) for n, t in items if n.startswith("replicated/")]
            shared.sort(key=lambda item: (view.shards[item[1].shard].rank - (r or 0)) % world_size)
            return replace(view, tensors=dict(own + shared))

        def tiersave_restore(split: bool, run_mib: int | None = None, rotate: bool = False) -> Callable[[], Any]:
            def run() -> None:
                os.environ["TIERSAVE_SPLIT_VERIFY"] = "1" if split else "0"  # read at each restore
                engine_reader.RUN_READ_BYTES = run_bytes if run_mib is None else run_mib << 20
                restore_module.rank_view = rotated if rotate else same_order  # type: ignore[assignment]
                ckpt.restore(1, into=state)
                if ckpt.last_restore is not None:
                    timers.wall["unchecked"] = ckpt.last_restore.unchecked_bytes

            return run

        methods = [("tiersave", tiersave_restore(True))]
        for variant in variants:
            if variant == "checks-all":
                methods.append(("tiersave-checks-all", tiersave_restore(False)))
            elif variant == "rotated":
                methods.append(("tiersave-rotated", tiersave_restore(True, rotate=True)))
            else:  # runs=MIB
                methods.append((f"tiersave-{variant}", tiersave_restore(True, int(variant.split("=", 1)[1]))))
        methods.append(("dcp", lambda: state_dict_loader.load(state, storage_reader=FileSystemReader(base / "dcp"))))
        slowest: dict[str, list[float]] = {name: [] for name, _ in methods}
        for rep in range(reps):
            k = rep % len(methods)
            for name, fn in methods[k:] + methods[:k]:
                seconds, text = timed(name, fn)
                job = torch.tensor([seconds], dtype=torch.float64)
                dist.all_reduce(job, op=dist.ReduceOp.MAX)  # the job's time is its slowest rank's
                slowest[name].append(float(job.item()))
                parts = f" | process CPU {timers.wall['process cpu']:.3f} s"
                if name.startswith("tiersave"):
                    w, c = timers.wall, timers.cpu
                    jobs = w.get("reader jobs", 0.0)
                    parts += (
                        f" | I/O threads: read syscalls {w.get('read syscalls', 0):.3f} s wall "
                        f"({c.get('read syscalls', 0):.3f} s cpu), crc {w.get('crc', 0):.3f} s "
                        f"wall ({c.get('crc', 0):.3f} s cpu), rest of jobs "
                        f"{jobs - w.get('read syscalls', 0) - w.get('crc', 0):.3f} s; "
                        f"left to the other ranks {w.get('unchecked', 0) / 1e9:.2f} GB"
                    )
                print(
                    f"rank {rank} rep {rep} {name}: {seconds:.3f} s ({nbytes / seconds / 1e9:.2f} GB/s){parts}",
                    flush=True,
                )
                if text and rank == 0:
                    print(text, flush=True)
    if rank == 0:
        _summary(slowest, reps)
    dist.barrier()
    dist.destroy_process_group()


def _summary(slowest: dict[str, list[float]], reps: int) -> None:
    """Per method: the slowest rank's seconds of each rep, their median, and the median over the reps of DCP's
    time divided by the method's (the ratio of the same rep: the machine's load changes from rep to rep)."""
    print(f"\nslowest rank, {reps} rep(s); load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    dcp = slowest["dcp"]
    for name, times in slowest.items():
        ratios = [d / t for d, t in zip(dcp, times, strict=True)]
        print(
            f"  {name:26s} median {statistics.median(times):.3f} s  vs DCP {statistics.median(ratios):.2f}x  "
            f"(each: {' '.join(f'{t:.3f}' for t in times)})",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    from tiersave.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", default="1GB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--port", type=int, default=29641)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a new temporary directory)")
    p.add_argument("--profile", action="store_true", help="cProfile the caller's thread of rank 0's restores")
    p.add_argument(
        "--variants",
        default="checks-all",
        help="tiersave restores timed beside the default one, comma-separated: 'checks-all' "
        "(TIERSAVE_SPLIT_VERIFY=0), 'rotated' (the order before 2026-11-24: rank r reads rank r's share of "
        "the replicated tensors first), 'runs=MIB' (runs of medium tensors at most MIB MiB); '' for none",
    )
    p.add_argument(
        "--chunk",
        default=None,
        help="checksum chunk size (default 64 MiB): tensors larger than one chunk are read chunk by chunk in "
        "the view's order, smaller ones in runs by file",
    )
    args = p.parse_args(argv)
    chunk = parse_bytes(args.chunk) if args.chunk else None
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in ("checks-all", "rotated") and not (v.startswith("runs=") and v.split("=", 1)[1].isdigit()):
            p.error(f"unknown variant {v!r}: expected 'checks-all', 'rotated' or 'runs=MIB'")
    root = tempfile.mkdtemp(prefix="ranks-restore-", dir=args.dir)
    print(f"load average {os.getloadavg()[0]:.1f} at the start; {os.cpu_count()} cpus", flush=True)
    try:
        mp.spawn(
            _rank,
            args=(args.ranks, root, parse_bytes(args.size), args.reps, args.port, args.profile, variants, chunk),
            nprocs=args.ranks,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
