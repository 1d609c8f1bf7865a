"""Ways to copy many small CPU tensors into a staging arena, per tensor, side by side (issue 15).

A ``save_async`` of 10^4-10^5 small tensors copies each into the arena on the caller's thread. Compared,
interleaved round by round, best of ``--reps`` per round, median over rounds, with one other Python thread
running (as the writer threads do during a save):

- ``ctypes.memmove``: one foreign call per tensor, releasing and retaking the GIL;
- ``memmove, GIL held``: the same C function through ``ctypes.PyDLL`` (what the engine uses for small tensors);
- ``torch.stack``: one call per group of 2048 same-shaped tensors into a strided view of the arena;
- ``torch._foreach_copy_``: one call per group, into ``unbind`` views of the arena.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/small_copies.py --count 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time
from collections.abc import Callable

import torch

from tiersave.engine.stage import small_memmove

SLOT = 4096  # each tensor at a 4 KiB-aligned offset, as in a shard


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=20000)
    p.add_argument("--bytes", type=int, default=1024, help="bytes per tensor (a multiple of 4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    n, size, elems = args.count, args.bytes, args.bytes // 4
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(elems, generator=g) for _ in range(n)]
    addrs = [t.data_ptr() for t in src]
    arena = torch.zeros(n * SLOT, dtype=torch.uint8)
    base = arena.data_ptr()
    floats = arena.view(torch.float32)
    group = 2048

    def loop(fn: Callable[[int, int, int], object]) -> None:
        for i, a in enumerate(addrs):
            fn(base + i * SLOT, a, size)

    def stack() -> None:
        for s in range(0, n, group):
            k = min(group, n - s)
            torch.stack(src[s : s + k], out=floats.as_strided((k, elems), (SLOT // 4, 1), s * SLOT // 4))

    def foreach() -> None:
        for s in range(0, n, group):
            k = min(group, n - s)
            out = floats.as_strided((k, elems), (SLOT // 4, 1), s * SLOT // 4)
            torch._foreach_copy_(list(out.unbind(0)), src[s : s + k])

    ways: dict[str, Callable[[], None]] = {
        "ctypes.memmove": lambda: loop(ctypes.memmove),
        "memmove, GIL held": lambda: loop(small_memmove),
        "torch.stack": stack,
        "torch._foreach_copy_": foreach,
    }
    stop = threading.Event()

    def wake_often() -> None:  # wants the GIL every 0.1 ms, as the writer threads of a save do
        while not stop.wait(1e-4):
            pass

    other = threading.Thread(target=wake_often, daemon=True)
    other.start()
    samples: dict[str, list[float]] = {k: [] for k in ways}
    try:
        for _ in range(args.rounds):
            for name, fn in ways.items():
                arena.zero_()
                best = min(_timed(fn) for _ in range(args.reps))
                for i in range(0, n, max(1, n // 16)):  # each way must really copy
                    assert torch.equal(floats[i * SLOT // 4 : i * SLOT // 4 + elems], src[i]), name
                samples[name].append(best)
    finally:
        stop.set()
        other.join(timeout=5)
    print(f"{n} tensors of {size} B, median of {args.rounds} rounds (best of {args.reps}), ns per tensor:")
    for name, values in samples.items():
        print(f"  {name:22s} {statistics.median(values) / n * 1e9:7.0f}")
    return 0


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    raise SystemExit(main())
