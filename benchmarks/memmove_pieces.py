"""Does copying in pieces below glibc's ``rep movsb`` ceiling make staging copies faster here?

glibc's ``memcpy`` picks its method by size (``ld.so --list-diagnostics``: ``rep_movsb_stop_threshold``,
``non_temporal_threshold``): ``rep movsb`` below the first, a vector loop up to the second, non-temporal
stores above. A staging copy of 1-64 MiB units takes the vector loop. This times, into a warm buffer:

- one thread: one ``memmove`` per copy of ``--mb`` MiB against the same bytes in pieces of several sizes, and
  the streaming copy (non-temporal stores, engine/memcopy.py) in 8 MiB pieces where it was built;
- the copier's threads (``HostCopier.copy_many``, as a ``save_async`` of host tensors stages; it cuts the
  copies into a queue of 8 MiB pieces its threads share): the GPT-like state's tensors, the same copies cut
  into ``--piece-kib`` pieces first, the copier's split before 2026-11-24 (the copies dealt out in halves of
  equal bytes, one per thread: ``equal halves``), ``copy_many`` with each copy routine, and torch's own
  ``Tensor.copy_`` of every tensor (its OpenMP threads; what DLRover's memory save does).

Rounds interleaved, order rotated; medians with ranges::

    PYTHONPATH=src .venv/bin/python benchmarks/memmove_pieces.py --mb 512 --state-gb 3 --reps 7
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Callable, Mapping

import torch

from tiersave.bench.workload import build_state, empty_like_state, gpt_like_spec
from tiersave.engine.memcopy import large_copy, stream_available
from tiersave.engine.pool import DaemonThreadPool
from tiersave.engine.stage import HostCopier
from tiersave.knobs import override_env


def _pieces(copies: list[tuple[int, int, int]], piece: int) -> list[tuple[int, int, int]]:
    return [(d + o, s + o, min(piece, n - o)) for d, s, n in copies for o in range(0, n, piece)]


def _halves(copies: list[tuple[int, int, int]], threads: int) -> list[list[tuple[int, int, int]]]:
    """The copier's split before 2026-11-24: ``copies`` cut into ``threads`` groups of equal bytes (a copy may
    be split between two groups)."""
    share = -(-sum(c[2] for c in copies) // threads)
    groups: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for dst, src, n in copies:
        while n:
            take = min(n, room)
            groups[-1].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
            if room == 0:
                groups.append([])
                room = share
    return [g for g in groups if g]


def _time(methods: Mapping[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    names = list(methods)
    out: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            methods[name]()
            out[name].append(time.perf_counter() - start)
    return out


def _print(title: str, gb: float, times: dict[str, list[float]]) -> None:
    print(title)
    for name, v in times.items():
        med = statistics.median(v)
        print(f"  {name:34s} {med * 1e3:8.1f} ms ({min(v) * 1e3:.1f}-{max(v) * 1e3:.1f})  {gb / med:5.1f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=512, help="one thread: MiB copied per round")
    p.add_argument("--state-gb", type=float, default=1.0, help="the copier's threads: state size in GB")
    p.add_argument("--piece-kib", type=int, default=512)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")

    n = args.mb << 20
    src, dst = torch.ones(n + 4096, dtype=torch.uint8), torch.zeros(n + 4096, dtype=torch.uint8)
    one = [(dst.data_ptr() + 64, src.data_ptr() + 64, n)]  # 64 B past the allocation, as torch tensors lie
    mm = ctypes.memmove

    def copier_of(cut: list[tuple[int, int, int]]) -> Callable[[], object]:
        return lambda: [mm(*c) for c in cut]

    single: dict[str, Callable[[], object]] = {"one memmove": copier_of(one)}
    for kib in (64, 256, 512, 1024, 8192):
        single[f"pieces of {kib} KiB"] = copier_of(_pieces(one, kib << 10))
    if stream_available():
        with override_env("TIERSAVE_STAGE_COPY", "stream"):
            stream, name = large_copy()
        single[f"{name}, pieces of 8192 KiB"] = lambda: [stream(*c) for c in _pieces(one, 8 << 20)]
    _print(f"one thread, {args.mb} MiB", n / 1e9, _time(single, args.reps))

    spec = gpt_like_spec(target_bytes=int(args.state_gb * 1e9))
    state, into = build_state(spec), empty_like_state(spec)
    for t in into.values():
        t.zero_()
    copies = [(d.data_ptr(), s.data_ptr(), s.nbytes) for d, s in zip(into.values(), state.values())]
    cut = _pieces(copies, args.piece_kib << 10)
    with override_env("TIERSAVE_STAGE_COPY", "memmove"):  # the routine is chosen when a copier is made
        copier = HostCopier()
    with override_env("TIERSAVE_STAGE_COPY", "stream" if stream_available() else "memmove"):
        fast = HostCopier()
    helpers = DaemonThreadPool(max(1, copier.threads - 1), "halves")

    parts = [copier_of(g) for g in _halves(copies, copier.threads)]

    def halves() -> None:
        futures = [helpers.submit(part) for part in parts[1:]]
        parts[0]()
        for fut in futures:
            fut.result()

    try:
        many: dict[str, Callable[[], object]] = {
            "copy_many (shared 8 MiB pieces)": lambda: copier.copy_many(copies),
            "equal halves, one per thread": halves,
            f"copy_many, {args.piece_kib} KiB pieces": lambda: copier.copy_many(cut),
            **({f"copy_many, {fast.routine}": lambda: fast.copy_many(copies)} if fast.routine != "memmove" else {}),
            "torch copy_ (DLRover-like)": lambda: [d.copy_(s) for d, s in zip(into.values(), state.values())],
        }
        gb = sum(c[2] for c in copies) / 1e9
        _print(f"the copier's {copier.threads} threads, GPT-like state {gb:.2f} GB", gb, _time(many, args.reps))
    finally:
        copier.close()
        fast.close()
        helpers.shutdown(wait=False)


if __name__ == "__main__":
    main()
