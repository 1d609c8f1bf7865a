"""What reusing the previous save's layout saves on the caller's thread (issues 10 and 15).

Times exactly the work a save does before it copies a byte (``savelayout.LayoutCache.layout``: flatten or the
check against the previous layout, the replicated selection and assignment, the plan) for one rank of N, laid
out afresh and reused, interleaved rep by rep, in one process. States: the benchmark's GPT-like state of
``--size`` bytes (``tiersave bench``'s, ~600 tensors), declared replicated as a DDP rank holds it, for N = 1, 2,
4; and flat dicts of ``--counts`` tensors of 1 KiB. Each rep starts with ``gc.collect()`` so that each timing
pays only its own collections.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/layout_reuse.py --size 1GB --counts 1000 10000 100000 --reps 5
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

import torch

from tiersave.bench.workload import build_state, gpt_like_spec
from tiersave.savelayout import LayoutCache
from tiersave.units import parse_bytes


def timed(cache: LayoutCache, state: Any, keys: tuple[str, ...], collective: bool) -> float:
    gc.collect()
    start = time.perf_counter()
    cache.layout(state, keys, collective=collective, chunk_for=lambda n: 64 << 20, max_shard_bytes=None)
    return time.perf_counter() - start


def measure(state: Any, keys: tuple[str, ...], rank: int, world: int, reps: int) -> tuple[float, float]:
    """Medians (seconds) of the layout laid out afresh and reused, interleaved."""
    fresh, reused = LayoutCache(rank, world, enabled=False), LayoutCache(rank, world)
    timed(reused, state, keys, world > 1)  # the first save: nothing to reuse
    a, b = [], []
    for _ in range(reps):
        a.append(timed(fresh, state, keys, world > 1))
        b.append(timed(reused, state, keys, world > 1))
    assert reused.reuses == reps, "the layout was not reused"
    return statistics.median(a), statistics.median(b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1GB", help="the GPT-like state's bytes")
    p.add_argument("--counts", type=int, nargs="*", default=[1000, 10000, 100000], help="tensors of 1 KiB")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f} at the start; {os.cpu_count()} cpus; medians of {args.reps}")
    model = build_state(gpt_like_spec("llama3-8b", parse_bytes(args.size)))
    state = {"model": model, "step": 1}
    for world in (1, 2, 4):
        a, b = measure(state, ("model",), 0, world, args.reps)
        print(
            f"GPT-like {args.size} ({len(model)} tensors), replicated, rank 0 of {world}: "
            f"afresh {a * 1e3:.2f} ms, reused {b * 1e3:.2f} ms ({a / b:.1f}x)"
        )
    del model, state
    for n in args.counts:
        flat = {f"experts.{i // 384}.{i % 384}.w": torch.randn(256) for i in range(n)}
        a, b = measure(flat, (), 0, 1, args.reps)
        print(f"{n} x 1 KiB: afresh {a / n * 1e6:.2f} us per tensor, reused {b / n * 1e6:.2f} ({a / b:.1f}x)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
