"""Several ranks, one checkpoint: a collective tiersave save and restore in ``ranks`` processes (gloo on
127.0.0.1), next to DCP's ``FileSystemWriter`` save and load and ``dcp.async_save`` in the same processes.

Two layouts of the state:

- sharded (default): each rank holds every ``ranks``-th tensor of the state and saves it, so the job's
  checkpoint is the state once;
- replicated (``BenchConfig.replicated``): every rank holds the whole state identically, as data-parallel
  ranks do. tiersave is told so (``replicated=["model"]``) and each rank writes about 1/N of it; DCP's
  planner writes each replicated tensor once on its own (on the rank with the smallest plan).

Each round runs every method once, in an order rotated from round to round (interleaved). Before each timed
phase the ranks meet at a barrier and rank 0 evicts the page cache, so every read is cold; every rank reports
its own duration and its own bytes (tiersave: what the rank wrote or read; DCP: the sizes of the rank's own
``__R_*.distcp`` files for a save, its state's bytes for a load). As MLPerf Storage does, the job's figures
are set by the slowest rank (all bytes over the slowest rank's duration) with the lowest rank's throughput
next to them. ``tiersave-async`` and ``dcp-async`` report the time the caller was blocked, and ``memcpy`` the
time one ``memcpy(3)`` per tensor takes to copy the bytes the rank itself writes, on the caller's thread, into
one buffer faulted in beforehand: the floor of any staging copy. ``memcpy`` runs right before
``tiersave-async`` in every round, so on a shared machine both see the same load. The config's warm-up rounds
run first and are reported for neither: they pay what a job pays once (tiersave's staging arena, the
fingerprint check of a ``replicated=`` declaration; ``Checkpointer.prepare`` moves the arena out of the first
save).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from .config import BenchConfig

__all__ = ["run_ranks"]

_TIMEOUT_S = 3600.0


def _rank_main(
    rank: int, world: int, port: int, opts: dict[str, Any], calibration: Any, barrier: Any, queue: Any
) -> None:
    try:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=_TIMEOUT_S))
        try:
            _run_rank(rank, world, opts, calibration, barrier, queue)
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        import traceback

        traceback.print_exc()  # the rank's stack on its stderr; the summary names the error
        queue.put(("error", rank, f"{type(exc).__name__}: {exc}"))
        barrier.abort()


def rank_state(opts: dict[str, Any], rank: int, world: int) -> tuple[dict[str, Any], list[Any]]:
    """A rank's state (``{"model": tensors}``) and the tensors it writes itself: the whole state, identical on
    every rank, with ``opts["replicated"]``, else only its share of the tensors (every ``world``-th)."""
    from ..replicated import assign, select
    from ..state import flatten
    from .workload import build_state, gpt_like_spec

    spec = gpt_like_spec(opts["model"], opts["size_bytes"])
    aligned = bool(opts.get("aligned_state"))
    if opts["replicated"]:  # every rank holds all of it, identically
        state: dict[str, Any] = {"model": build_state(spec, seed=opts["seed"], aligned=aligned)}
        owner = assign(select(state, flatten(state), ["model"]).tensors, world)
        return state, [t for name, t in state["model"].items() if owner[f"model.{name}"] == rank]
    share = replace(spec, tensors=tuple(t for i, t in enumerate(spec.tensors) if i % world == rank))
    state = {"model": build_state(share, seed=opts["seed"] + rank, aligned=aligned)}  # only the share is allocated
    return state, list(state["model"].values())


def _run_rank(rank: int, world: int, opts: dict[str, Any], calibration: Any, barrier: Any, queue: Any) -> None:
    import torch
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter

    from ..checkpointer import Checkpointer
    from ..storage.posix import LocalStorage
    from .device import evict

    directory = Path(opts["directory"])
    state, own = rank_state(opts, rank, world)
    keys = ["model"] if opts["replicated"] else []
    state_bytes = sum(t.nbytes for t in state["model"].values())
    own_bytes = sum(t.nbytes for t in own)
    spans = [(t.data_ptr(), t.nbytes) for t in own]
    scratch = torch.empty(max(own_bytes, 1), dtype=torch.uint8)
    scratch.fill_(0)  # fault the destination in: the staging arena is warm too after the warm-up round

    def cold(path: Path) -> None:
        barrier.wait(_TIMEOUT_S)
        if rank == 0:
            evict([path], drop_caches=opts["drop_caches"])
        barrier.wait(_TIMEOUT_S)

    def dcp_bytes(path: Path) -> int:
        return sum(p.stat().st_size for p in path.glob(f"__{rank}_*.distcp"))

    storage = LocalStorage(directory / "tiersave", io="auto", calibration=calibration)
    with Checkpointer(
        storage, io_threads=opts["io_threads"], coordination_timeout_s=_TIMEOUT_S, event_log=False, keep_last=2
    ) as ckpt:

        def tiersave_save(rnd: int) -> tuple[float, int]:
            start = time.perf_counter()
            handle = ckpt.save(2 * rnd + 1, state, replicated=keys)
            return time.perf_counter() - start, handle.stats.tensor_bytes

        def tiersave_load(rnd: int) -> tuple[float, int]:
            start = time.perf_counter()
            ckpt.restore(2 * rnd + 1, into=state)
            seconds = time.perf_counter() - start
            return seconds, ckpt.last_restore.bytes_read if ckpt.last_restore is not None else state_bytes

        def tiersave_async(rnd: int) -> tuple[float, int, float]:
            cpu, start = time.process_time(), time.perf_counter()
            handle = ckpt.save_async(2 * rnd + 2, state, replicated=keys)
            blocked, cpu = time.perf_counter() - start, time.process_time() - cpu
            handle.result(_TIMEOUT_S)
            return blocked, handle.stats.tensor_bytes, cpu

        def memcpy(rnd: int) -> tuple[float, int, float]:
            # memcpy(3) of the rank's own bytes on this one thread, back to back into one warm buffer
            cpu, start = time.process_time(), time.perf_counter()
            dst = scratch.data_ptr()
            for src, n in spans:
                ctypes.memmove(dst, src, n)
                dst += n
            return time.perf_counter() - start, own_bytes, time.process_time() - cpu

        def dcp_save(rnd: int) -> tuple[float, int]:
            path = directory / "dcp" / f"save-{rnd}"
            start = time.perf_counter()
            state_dict_saver.save(state, storage_writer=FileSystemWriter(path))
            return time.perf_counter() - start, dcp_bytes(path)

        def dcp_load(rnd: int) -> tuple[float, int]:
            start = time.perf_counter()
            state_dict_loader.load(state, storage_reader=FileSystemReader(directory / "dcp" / f"save-{rnd}"))
            return time.perf_counter() - start, state_bytes

        def dcp_async(rnd: int) -> tuple[float, int]:
            path = directory / "dcp" / f"async-{rnd}"
            start = time.perf_counter()
            response = state_dict_saver.async_save(state, storage_writer=FileSystemWriter(path))
            blocked = time.perf_counter() - start
            if isinstance(response, state_dict_saver.AsyncSaveResponse):  # other stager types
                response.upload_completion.result()
            else:
                response.result()
            return blocked, dcp_bytes(path)

        # each save is followed by its load, so a load always reads the round's own checkpoint
        # memcpy runs right before tiersave-async, so the two see the same moment of a shared machine's load
        groups: list[list[tuple[str, Callable[[int], tuple[Any, ...]]]]] = [
            [("tiersave-save", tiersave_save), ("tiersave-load", tiersave_load)],
            [("memcpy", memcpy), ("tiersave-async", tiersave_async)],
        ]
        if opts["dcp"]:
            groups.append([("dcp-save", dcp_save), ("dcp-load", dcp_load)])
        if opts["dcp_async"]:
            groups.append([("dcp-async", dcp_async)])
        for rnd in range(opts["warmup"] + opts["rounds"]):
            k = rnd % len(groups)
            row: dict[str, Any] = {}
            for group in groups[k:] + groups[:k]:
                for name, run in group:
                    cold(directory)
                    row[name] = run(rnd)  # seconds, bytes[, the process's CPU seconds meanwhile]
            if rnd >= opts["warmup"]:  # the first saves allocate the staging arena: not the steady state
                queue.put(("ok", rank, rnd - opts["warmup"], row))
            barrier.wait(_TIMEOUT_S)
            if rank == 0:
                shutil.rmtree(directory / "dcp", ignore_errors=True)


def run_ranks(config: BenchConfig, calibration: Any) -> dict[str, Any]:
    """Run the collective benchmark in ``config.ranks`` processes; per round and method, every rank's figures
    and the job's (slowest rank, lowest rank's throughput); a summary of medians over the rounds.

    Raises:
        ConfigError: a rank failed (its error is in the message).
    """
    import socket

    from ..errors import ConfigError

    ctx = mp.get_context("spawn")  # a clean interpreter per rank: no inherited threads or locks
    world = config.ranks
    barrier = ctx.Barrier(world)
    queue = ctx.Queue()
    directory = config.directory / "ranks"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = {
        "directory": str(directory),
        "model": config.model,
        "size_bytes": config.size_bytes,
        "seed": config.seed,
        "aligned_state": config.aligned_state,
        "replicated": config.replicated,
        "io_threads": config.io_threads,
        "drop_caches": config.drop_caches,
        "rounds": config.checkpoints,
        "warmup": config.warmup,
        "dcp": "dcp" in config.peers,
        "dcp_async": "dcp-async" in config.peers,
    }
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, opts, calibration, barrier, queue), daemon=True)
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
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
            p.join(timeout=10)
    if not config.keep:
        shutil.rmtree(directory, ignore_errors=True)
    if errors or len(reports) < expected:
        raise ConfigError("multi-rank benchmark failed: " + ("; ".join(errors) or "a rank exited early"))
    rounds = [_round([r for r in reports if r[2] == rnd]) for rnd in range(config.checkpoints)]
    return {"ranks": world, "replicated": config.replicated, "rounds": rounds, "summary": _summary(rounds)}


def _round(reports: list[tuple[Any, ...]]) -> dict[str, Any]:
    """One round: per method, every rank's seconds and bytes, the slowest rank, the job's and the lowest
    rank's throughput (the keys of tiersave's save and load kept at the top for older readers)."""
    rows = sorted(reports, key=lambda r: r[1])
    methods: dict[str, Any] = {}
    for name in rows[0][3]:
        per_rank = [{"rank": r[1], "seconds": round(r[3][name][0], 6), "bytes": r[3][name][1]} for r in rows]
        for x, r in zip(per_rank, rows):
            if len(r[3][name]) > 2:
                x["cpu_s"] = round(r[3][name][2], 6)
        slowest = max(x["seconds"] for x in per_rank)
        total = sum(x["bytes"] for x in per_rank)
        methods[name] = {
            "per_rank": per_rank,
            "bytes": total,
            "slowest_s": slowest,
            "gbps": total / slowest / 1e9 if slowest > 0 else None,
            "lowest_rank_gbps": min(x["bytes"] / x["seconds"] for x in per_rank if x["seconds"] > 0) / 1e9,
        }
    save, load = methods["tiersave-save"], methods["tiersave-load"]
    return {
        "methods": methods,
        "bytes": save["bytes"],
        "slowest_save_s": save["slowest_s"],
        "slowest_load_s": load["slowest_s"],
        "save_gbps": save["gbps"],
        "load_gbps": load["gbps"],
        "lowest_rank_save_gbps": save["lowest_rank_gbps"],
        "lowest_rank_load_gbps": load["lowest_rank_gbps"],
    }


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of each method's slowest rank, and the ratios the targets are stated in:
    DCP's slowest rank over tiersave's (save, load), and the worst rank's async blocked time over its memcpy.

    Where ranks outnumber the cores, which rank's memcpy the scheduler runs first is a lottery (two ranks
    finish theirs in half the time of the other two), so two more figures sit beside the worst rank's: the
    job's (the slowest rank's blocked time over the slowest rank's memcpy: what a step waiting for every
    rank sees) and the CPU the worst rank's process spent while its caller was blocked over its memcpy's."""

    def median(method: str) -> float | None:
        values = [r["methods"][method]["slowest_s"] for r in rounds if method in r["methods"]]
        return statistics.median(values) if values else None

    slowest = {m: median(m) for m in rounds[0]["methods"]}
    out: dict[str, Any] = {"slowest_s": slowest}
    for what, ours, theirs in (
        ("save_vs_dcp", "tiersave-save", "dcp-save"),
        ("load_vs_dcp", "tiersave-load", "dcp-load"),
    ):
        a, b = slowest.get(ours), slowest.get(theirs)
        out[what] = b / a if a and b else None
    blocked = [
        max(
            m["per_rank"][i]["seconds"] / max(r["methods"]["memcpy"]["per_rank"][i]["seconds"], 1e-9)
            for i in range(len(m["per_rank"]))
        )
        for r in rounds
        for m in [r["methods"]["tiersave-async"]]
    ]
    out["async_blocked_vs_memcpy"] = statistics.median(blocked)
    out["async_job_blocked_vs_memcpy"] = statistics.median(
        r["methods"]["tiersave-async"]["slowest_s"] / max(r["methods"]["memcpy"]["slowest_s"], 1e-9) for r in rounds
    )
    cpu = [
        max(
            a.get("cpu_s", 0.0) / max(m.get("cpu_s", 0.0), 1e-9)
            for a, m in zip(r["methods"]["tiersave-async"]["per_rank"], r["methods"]["memcpy"]["per_rank"])
        )
        for r in rounds
    ]
    out["async_cpu_vs_memcpy"] = statistics.median(cpu)
    return out
