"""Several ranks at once: tiersave in ``ranks`` processes, each saving and restoring its share of the state.

Each rank takes every ``ranks``-th tensor of the state, so the shares are about equal, and saves under
its own root (as ranks of a data-parallel job write their own shards). The ranks start each phase
together (a barrier), the page cache is evicted between phases, and every rank reports its own duration;
the config's warm-up rounds run first and are not reported.
As MLPerf Storage does, the job's figure is set by the slowest rank: aggregate throughput is all bytes
over the slowest rank's duration, and the lowest per-rank throughput is reported next to it.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from .config import BenchConfig

__all__ = ["run_ranks"]

_TIMEOUT_S = 3600.0


def _rank_main(
    rank: int,
    world: int,
    directory: str,
    model: str,
    size_bytes: int,
    io_threads: int | None,
    rounds: int,
    warmup: int,
    drop_caches: bool,
    calibration: Any,
    seed: int,
    barrier: Any,
    queue: Any,
) -> None:
    try:
        from pathlib import Path

        from ..checkpointer import Checkpointer
        from ..storage.posix import LocalStorage
        from .device import evict
        from .workload import build_state, gpt_like_spec

        spec = gpt_like_spec(model, size_bytes)
        full = build_state(spec, seed=seed)
        share = {name: t for i, (name, t) in enumerate(full.items()) if i % world == rank}
        del full
        nbytes = sum(t.numel() * t.element_size() for t in share.values())
        root = Path(directory) / f"rank-{rank:05d}"
        storage = LocalStorage(root, io="auto", calibration=calibration)
        with Checkpointer(storage, io_threads=io_threads) as ckpt:
            for rnd in range(warmup + rounds):
                barrier.wait(_TIMEOUT_S)
                if rank == 0:
                    evict([Path(directory)], drop_caches=drop_caches)
                barrier.wait(_TIMEOUT_S)
                start = time.perf_counter()
                ckpt.save(rnd + 1, share)
                save_s = time.perf_counter() - start
                barrier.wait(_TIMEOUT_S)
                if rank == 0:
                    evict([Path(directory)], drop_caches=drop_caches)
                barrier.wait(_TIMEOUT_S)
                start = time.perf_counter()
                ckpt.restore(rnd + 1, into=share)
                load_s = time.perf_counter() - start
                if rnd >= warmup:  # the first saves allocate the staging arena: not the steady state
                    queue.put(("ok", rank, rnd - warmup, nbytes, save_s, load_s))
                ckpt.prune(1)
    except BaseException as exc:
        queue.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        barrier.abort()


def run_ranks(config: BenchConfig, calibration: Any) -> dict[str, Any]:
    """Run tiersave (io=auto) in ``config.ranks`` processes; per-rank and job figures, per round.

    Raises:
        ConfigError: a rank failed (its error is in the message).
    """
    from ..errors import ConfigError

    ctx = mp.get_context("spawn")  # a clean interpreter per rank: no inherited threads or locks
    world = config.ranks
    barrier = ctx.Barrier(world)
    queue = ctx.Queue()
    directory = config.directory / "ranks"
    directory.mkdir(parents=True, exist_ok=True)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                r,
                world,
                str(directory),
                config.model,
                config.size_bytes,
                config.io_threads,
                config.checkpoints,
                config.warmup,
                config.drop_caches,
                calibration,
                config.seed,
                barrier,
                queue,
            ),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    reports: list[tuple[Any, ...]] = []
    errors: list[str] = []
    expected = world * config.checkpoints
    deadline = time.monotonic() + _TIMEOUT_S
    while len(reports) < expected and not errors and time.monotonic() < deadline:
        try:
            item = queue.get(timeout=1.0)
        except Exception:  # queue.Empty: check whether the ranks are still alive
            if not any(p.is_alive() for p in procs):
                break
            continue
        if item[0] == "error":
            errors.append(f"rank {item[1]}: {item[2]}")
        else:
            reports.append(item)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()
    if not config.keep:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    if errors or len(reports) < expected:
        raise ConfigError("multi-rank benchmark failed: " + ("; ".join(errors) or "a rank exited early"))
    rounds = []
    for rnd in range(config.checkpoints):
        rows = sorted((r for r in reports if r[2] == rnd), key=lambda r: r[1])
        total = sum(r[3] for r in rows)
        slow_save = max(r[4] for r in rows)
        slow_load = max(r[5] for r in rows)
        rounds.append(
            {
                "bytes": total,
                "per_rank": [
                    {"rank": r[1], "bytes": r[3], "save_s": round(r[4], 6), "load_s": round(r[5], 6)} for r in rows
                ],
                "slowest_save_s": round(slow_save, 6),
                "slowest_load_s": round(slow_load, 6),
                "save_gbps": total / slow_save / 1e9,
                "load_gbps": total / slow_load / 1e9,
                "lowest_rank_save_gbps": min(r[3] / r[4] for r in rows) / 1e9,
                "lowest_rank_load_gbps": min(r[3] / r[5] for r in rows) / 1e9,
            }
        )
    return {"ranks": world, "rounds": rounds}
