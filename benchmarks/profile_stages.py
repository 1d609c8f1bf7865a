"""Where a large save and restore spend their CPU time, stage by stage (issue 16).

Saves the `tiersave bench` state (a GPT-like fp32 state with Adam moments, ``--size`` GB) with
``Checkpointer.save`` (blocking: staged, written, fsync'd, committed) and restores it from a cold page
cache into the live state and into new tensors, ``--reps`` times each, interleaved. Each operation reports
its wall time and the process's CPU time (``os.times``: user + system, all threads).

With ``--perf`` the kernel's sampling profiler (``perf record -e cpu-clock -g``, kernel and user stacks)
watches the process during ``--reps`` further operations of each kind (one recording per kind); every
sample, a thread on a CPU, is attributed to one stage by the frames of its stack (the first rule that
matches, in this order):

- ``checksum``: CRC-32C (``crc32c``);
- ``page faults``: first touch of memory (``page_fault``; new tensors on restore);
- ``fsync``; ``write syscall`` / ``read syscall``: ``pwrite`` / ``preadv`` in the kernel (for direct I/O:
  pinning the user pages, building and submitting the requests; waiting for the device is not CPU);
- ``copy``: ``memmove`` / ``memcpy`` / ``memset`` in user space (staging into the arena, bounce buffers,
  a group's copy out);
- ``hand-off``: futexes and the scheduler (threads waking each other);
- ``python``: the interpreter (bookkeeping: plan, manifest, commit);
- ``other``: the rest (torch, numpy, unresolved frames).

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/profile_stages.py --dir /tmp/tiersave-prof --size 3 --reps 3 \\
        --perf

Run as root for a cold page cache and for ``perf`` (``drop_caches``); otherwise files are evicted with
``POSIX_FADV_DONTNEED``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tiersave import Checkpointer
from tiersave.bench.device import evict, measure_raw
from tiersave.bench.workload import build_state, empty_like_state, gpt_like_spec
from tiersave.storage.posix import LocalStorage

# (stage, substrings of a sampled stack; the first stage with a frame matching any of them wins)
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("evict", ("drop_caches", "fadvise")),  # the script's cache eviction before a restore: not counted
    ("checksum", ("crc32c",)),
    ("page faults", ("handle_mm_fault",)),
    ("fsync", ("fsync",)),
    ("write syscall", ("ext4_file_write_iter", "vfs_write", "pwrite64")),
    ("read syscall", ("ext4_file_read_iter", "vfs_read", "preadv")),
    ("copy", ("memmove", "memcpy", "memset")),
    ("hand-off", ("futex", "sem_", "pthread_cond", "sched_yield", "schedule")),
    ("python", ("libpython", "python3")),
]
STAGES = [stage for stage, _ in RULES if stage != "evict"] + ["other"]


def stage_of(stack: str) -> str:
    for stage, needles in RULES:
        if any(n in stack for n in needles):
            return stage
    return "other"


def summarize_perf(data: Path, hz: int) -> dict[str, float]:
    """CPU seconds per stage from one ``perf record`` (``cpu-clock`` samples of this process's threads)."""
    text = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "comm,ip,sym,dso"], capture_output=True, text=True, timeout=600
    ).stdout
    out: dict[str, float] = collections.defaultdict(float)
    for sample in text.split("\n\n"):
        if sample.strip():
            out[stage_of(sample)] += 1.0 / hz
    out.pop("evict", None)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name, t in a.items():
        if not torch.equal(t, b[name]):
            raise SystemExit(f"restored tensor {name!r} differs from the saved one")


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


class Profiler:
    """``perf record`` of this process's threads (``cpu-clock``, kernel and user stacks); one recording per
    ``start``/``stop``."""

    def __init__(self, enabled: bool, out_dir: Path, hz: int) -> None:
        self.enabled, self.out_dir, self.hz = enabled, out_dir, hz
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, name: str) -> Path:
        data = self.out_dir / f"perf.{name}.data"
        if self.enabled:
            cmd = [
                "perf",
                "record",
                "-e",
                "cpu-clock",
                "-F",
                str(self.hz),
                "-g",
                "-p",
                str(os.getpid()),
                "-o",
                str(data),
            ]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # let it attach
        return data

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def prepare(
    directory: str | None, prefix: str, size_gb: float
) -> tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """The run's directory (``directory``, else a new temporary one named ``prefix``...), an empty ``ckpt``
    root in it, the `tiersave bench` state of ``size_gb`` GB, an empty twin to restore into and the state's
    bytes; prints the state's size and the load average."""
    base = Path(directory or tempfile.mkdtemp(prefix=prefix))
    root = base / "ckpt"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    spec = gpt_like_spec("llama3-8b", int(size_gb * 1e9))
    state = build_state(spec)
    live = empty_like_state(spec)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"state: {len(state)} tensors, {nbytes / 1e9:.2f} GB; load average {os.getloadavg()[0]:.2f}", flush=True)
    return base, root, state, live, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="directory on the file system to measure (default: a temp dir)")
    p.add_argument("--size", type=float, default=3.0, help="state size in GB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--io", default="auto", choices=["auto", "direct", "buffered"])
    p.add_argument("--no-drop-caches", action="store_true", help="evict with fadvise only (no drop_caches)")
    p.add_argument("--perf", action="store_true", help="attribute CPU samples to stages with perf record")
    p.add_argument("--hz", type=int, default=499, help="perf samples per second")
    args = p.parse_args()

    base, root, state, live, nbytes = prepare(args.dir, "tiersave-prof-", args.size)
    storage = LocalStorage(root, io=args.io)
    ckpt = Checkpointer(storage, keep_last=2)
    ckpt.save(0, state)  # warm-up: allocates the staging arena, calibrates the I/O policy
    prof = Profiler(args.perf, base, args.hz)
    samples: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    ops = ["save", "restore_into", "restore_new"]
    step = 0
    raw_write: list[float] = []
    raw_read: list[float] = []
    for rep in range(args.reps):
        raw = measure_raw(
            base, nbytes, drop_caches=not args.no_drop_caches
        )  # the device's limits in the same rep, best of 1 and 4 streams
        raw_write.append(raw.best_write)
        raw_read.append(raw.best_read)
        for op in ops[rep % 3 :] + ops[: rep % 3]:  # rotate the order every rep
            if op == "save":
                step += 1
                t0, c0 = time.perf_counter(), _cpu()
                ckpt.save(step, state)
            else:
                evict([root], drop_caches=not args.no_drop_caches)
                into = live if op == "restore_into" else None
                t0, c0 = time.perf_counter(), _cpu()
                out = ckpt.restore(step, into=into)
            wall, cpu = time.perf_counter() - t0, _cpu() - c0
            samples[op].append((wall, cpu))
            if op != "save":
                _same(state, out)
                del out
    # Profiled reps: one recording per operation kind (raw samples carry no time to split them by).
    profiles: dict[str, Any] = {}
    if args.perf:
        for op in ops:
            data = prof.start(op)
            for _ in range(args.reps):
                if op == "save":
                    step += 1
                    ckpt.save(step, state)
                else:
                    evict([root], drop_caches=not args.no_drop_caches)
                    ckpt.restore(step, into=live if op == "restore_into" else None)
            prof.stop()
            profiles[op] = {k: v / args.reps for k, v in summarize_perf(data, args.hz).items()}
    ckpt.close()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    raw_w, raw_r = statistics.median(raw_write), statistics.median(raw_read)
    print(f"\nraw direct write {raw_w:.2f} GB/s, best raw read {raw_r:.2f} GB/s (medians of {args.reps})")
    print(f"\n| operation | wall s (median of {args.reps}) | GB/s | vs raw | CPU s (all threads) |")
    print("| --- | --- | --- | --- | --- |")
    for op in ops:
        wall = statistics.median(w for w, _ in samples[op])
        cpu = statistics.median(c for _, c in samples[op])
        gbps = nbytes / 1e9 / wall
        ref = raw_w if op == "save" else raw_r
        print(f"| {op} | {wall:.2f} | {gbps:.2f} | {gbps / ref:.2f}x | {cpu:.2f} |")
    if profiles:
        stages = STAGES
        print("\nCPU seconds per operation by stage (perf cpu-clock samples, mean of the profiled reps):\n")
        print("| operation | " + " | ".join(stages) + " | total |")
        print("| --- " * (len(stages) + 2) + "|")
        for op in ops:
            row = profiles[op]
            print(f"| {op} | " + " | ".join(f"{row.get(s, 0.0):.2f}" for s in stages) + f" | {sum(row.values()):.2f} |")
    shutil.rmtree(root, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
