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
functions of the caller's thread under cProfile for both restores.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/ranks_restore.py --ranks 2 --size 1GB --reps 3 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _rank(rank: int, world: int, root: str, size: int, reps: int, port: int, profile: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    import tiersave
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
    with tiersave.Checkpointer(base / "tiersave", keep_last=2, event_log=False, handle_sigterm=False) as ckpt:
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

        def tiersave_restore(split: bool) -> Callable[[], Any]:
            def run() -> None:
                os.environ["TIERSAVE_SPLIT_VERIFY"] = "1" if split else "0"  # read at each restore
                ckpt.restore(1, into=state)
                if ckpt.last_restore is not None:
                    timers.wall["unchecked"] = ckpt.last_restore.unchecked_bytes

            return run

        methods = [("tiersave", tiersave_restore(True)), ("tiersave-checks-all", tiersave_restore(False))]
        methods.append(("dcp", lambda: state_dict_loader.load(state, storage_reader=FileSystemReader(base / "dcp"))))
        for rep in range(reps):
            k = rep % len(methods)
            for name, fn in methods[k:] + methods[:k]:
                seconds, text = timed(name, fn)
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
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from tiersave.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size", default="1GB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--port", type=int, default=29641)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a new temporary directory)")
    p.add_argument("--profile", action="store_true", help="cProfile the caller's thread of rank 0's restores")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="ranks-restore-", dir=args.dir)
    print(f"load average {os.getloadavg()[0]:.1f} at the start; {os.cpu_count()} cpus", flush=True)
    try:
        mp.spawn(
            _rank,
            args=(args.ranks, root, parse_bytes(args.size), args.reps, args.port, args.profile),
            nprocs=args.ranks,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
