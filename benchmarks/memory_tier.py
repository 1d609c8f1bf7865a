"""Issue 5's memory-tier target: restore from ``mem://`` against memcpy and against a cold local disk.

One run, same state (a GPT-like dict of fp32 tensors), same process:

- ``memcpy``: copying the state into preallocated tensors (the yardstick);
- restore from the memory tier (``/dev/shm``) into the live state, and into new tensors;
- restore from the local disk with a cold page cache (``drop_caches`` as root, else ``POSIX_FADV_DONTNEED``).

Usage::

    .venv/bin/python benchmarks/memory_tier.py --state-mb 1024 --dir DIR \
        --json benchmarks/results/memory_tier.json

Every restore is checksum-verified (as always); reported rates are state bytes over wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from async_save import gpt_like_state, memcpy_s, state_bytes, tensors_of

import tiersave
from tiersave.storage.memory import MemoryStorage


def evict(root: Path) -> str:
    """Drop the checkpoint files from the page cache; returns how."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        return "fadvise"


def timed_restore(ckpt: tiersave.Checkpointer, into=None) -> float:
    t0 = time.perf_counter()
    ckpt.restore(into=into)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=".", help="where the local-disk checkpoint goes")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    state = gpt_like_state(args.state_mb)
    nbytes = state_bytes(state)
    live = {
        "model": {k: torch.empty_like(v) for k, v in state["model"].items()},
        "optim": {m: {k: torch.empty_like(v) for k, v in d.items()} for m, d in state["optim"].items()},
        "step": 0,
    }
    for t in tensors_of(live):
        t.zero_()  # preallocated and touched, like a live training state
    mc = memcpy_s(state)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    local_root = Path(tempfile.mkdtemp(dir=args.dir, prefix="tiersave-memtier-"))
    results: dict[str, list[float]] = {"memory into": [], "memory new": [], "local cold into": [], "local cold new": []}
    how = ""
    try:
        with tiersave.Checkpointer(f"mem://{name}") as mem, tiersave.Checkpointer(local_root) as local:
            mem.save(1, state)
            local.save(1, state)
            timed_restore(mem, live)  # warm-up: thread pools, allocator
            for _ in range(args.rounds):
                results["memory into"].append(timed_restore(mem, live))
                results["memory new"].append(timed_restore(mem))
                how = evict(local_root)
                results["local cold into"].append(timed_restore(local, live))
                how = evict(local_root)
                results["local cold new"].append(timed_restore(local))
    finally:
        MemoryStorage(name).destroy()
        import shutil

        shutil.rmtree(local_root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "machine": {"cpus": os.cpu_count(), "load_1min": os.getloadavg()[0], "eviction": how},
        "state_bytes": nbytes,
        "memcpy_s": mc,
        "seconds": med,
        "gbps": {k: nbytes / v / 1e9 for k, v in med.items()},
        "ratios": {
            "memory_into_vs_memcpy": mc / med["memory into"],
            "memory_into_speedup_vs_local_cold_into": med["local cold into"] / med["memory into"],
            "memory_new_speedup_vs_local_cold_new": med["local cold new"] / med["memory new"],
        },
    }
    print(
        f"state {nbytes / 2**30:.2f} GiB; memcpy {mc * 1e3:.0f} ms ({nbytes / mc / 1e9:.1f} GB/s); "
        f"cache eviction: {how}; load average {os.getloadavg()[0]:.2f}"
    )
    for k, v in med.items():
        print(f"  restore {k:16} {v * 1e3:7.0f} ms  {nbytes / v / 1e9:5.2f} GB/s")
    for k, v in report["ratios"].items():
        print(f"  {k:40} {v:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
