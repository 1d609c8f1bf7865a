"""Many ranks x many tensors end to end: a mixture-of-experts job's collective saves, async saves and restores.

Each of ``--ranks`` processes (gloo on 127.0.0.1, ``torch.multiprocessing``) holds its own expert-parallel
state of about ``--tensors-per-rank`` small tensors of ``--tensor-kib`` KiB: its experts' weights
(``model.layers.L.mlp.experts.E.w1.weight``, w1/w2/w3) and their Adam moments (``optim.<name>.exp_avg``,
``.exp_avg_sq``), plus a few tensors every rank holds alike (embedding, norms, router), declared
``replicated=["shared"]``. Per run it measures, on every rank:

- ``save``: a blocking ``save`` (caller's time);
- ``async_blocked`` / ``async_total``: a ``save_async``'s blocked time and the time until it is committed;
- ``restore``: ``restore(into=state)`` of the newest step, checked bit-exact against what was saved;
- the vote: rank 0's gather (entering the vote to every rank's part in), its decision (merging the parts into
  the global manifest, the compact encoding, the write) and its reply, against the other ranks' wait;

and, on rank 0: the global manifest's size and its parse time (``Manifest.parse``), and the process's memory
peak (``ru_maxrss``).

``--rank0-cpu`` measures rank 0's commit path alone, in this process, in CPU seconds (``time.process_time``,
fair on a loaded machine): one rank's part is built from a real single-process save of the state, copied
for each of ``--ranks`` ranks and encoded as it travels; then the parts are decoded, merged
(``collective.merge_parts``) and the global manifest encoded, as rank 0 does in the vote.

Compare with another tree by running this script with that tree's ``src`` first on ``PYTHONPATH``, alternating,
in the same minutes.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/ranks_many_tensors.py --ranks 8 --tensors-per-rank 50000 \\
        --tensor-kib 0.5 --runs 3 --json out.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MATRICES = ("w1", "w2", "w3")
LAYERS = 48


def moe_state(rank: int, tensors: int, nbytes: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s expert-parallel state: ~``tensors`` tensors of ``nbytes`` bytes (weights and two Adam
    moments per expert matrix), its own experts numbered after the other ranks', a few replicated tensors."""
    per_expert = len(MATRICES) * 3
    experts = max(1, -(-tensors // (LAYERS * per_expert)))
    numel = max(1, nbytes // 2)
    gen = torch.Generator().manual_seed(rank * 1_000_003 + step)
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    count = 0
    for layer in range(LAYERS):
        for e in range(experts):
            for m in MATRICES:
                if count >= tensors:
                    break
                name = f"model.layers.{layer}.mlp.experts.{rank * experts + e}.{m}.weight"
                model[name] = torch.randn(numel, generator=gen, dtype=torch.float32).to(torch.bfloat16)
                optim[name] = {
                    "exp_avg": torch.randn(numel, generator=gen, dtype=torch.float32).to(torch.bfloat16),
                    "exp_avg_sq": torch.rand(numel, generator=gen, dtype=torch.float32).to(torch.bfloat16),
                }
                count += 3
    shared_gen = torch.Generator().manual_seed(step)  # identical on every rank: declared replicated
    shared = {
        "embed.weight": torch.randn(4096, generator=shared_gen),
        "norm.weight": torch.randn(256, generator=shared_gen),
        **{f"model.layers.{layer}.mlp.router.weight": torch.randn(64, generator=shared_gen) for layer in range(8)},
    }
    return {"model": model, "optim": optim, "shared": shared, "data": {"rank": rank, "position": step * 100 + rank}}


def _tensors(state: dict[str, Any]) -> list[torch.Tensor]:
    out = list(state["model"].values()) + list(state["shared"].values())
    for moments in state["optim"].values():
        out += list(moments.values())
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb)) and a["data"] == b["data"]


def _rank(rank: int, world: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import tiersave
    from tiersave.format.layout import MANIFEST_NAME, step_dirname
    from tiersave.format.manifest import Manifest

    nbytes = int(args.tensor_kib * 1024)
    rows: list[dict[str, Any]] = []
    timeout = args.timeout
    with tiersave.Checkpointer(
        args.root, keep_last=2, event_log=False, handle_sigterm=False, coordination_timeout_s=timeout
    ) as ckpt:
        for run in range(args.runs):
            row: dict[str, Any] = {"run": run}
            step = 2 * run + 1
            state = moe_state(rank, args.tensors_per_rank, nbytes, step)
            row["tensors"] = len(_tensors(state))
            dist.barrier()
            start = time.perf_counter()
            handle = ckpt.save(step, state, replicated=["shared"])
            row["save"] = time.perf_counter() - start
            row["save_vote"] = handle.stats.extra.get("vote", {})
            state2 = moe_state(rank, args.tensors_per_rank, nbytes, step + 1)
            dist.barrier()
            start = time.perf_counter()
            handle = ckpt.save_async(step + 1, state2, replicated=["shared"])
            row["async_blocked"] = time.perf_counter() - start
            handle.result(timeout * 3)
            row["async_total"] = time.perf_counter() - start
            row["async_vote"] = handle.stats.extra.get("vote", {})
            del state
            live = moe_state(rank, args.tensors_per_rank, nbytes, 0)
            dist.barrier()
            profiler = cProfile.Profile() if args.profile_restore else None
            cpu = time.process_time()
            start = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            ckpt.restore(into=live)
            if profiler is not None:
                profiler.disable()
            row["restore"] = time.perf_counter() - start
            row["restore_cpu"] = time.process_time() - cpu
            if profiler is not None:
                profiler.dump_stats(os.path.join(args.profile_restore, f"restore-{world}r-rank{rank}-run{run}.prof"))
            row["bit_exact"] = _same(live, state2)
            if rank == 0:
                data = (args.root_path / step_dirname(step + 1) / MANIFEST_NAME).read_bytes()
                start = time.perf_counter()
                parsed = Manifest.parse(data, path="bench", expect_step=step + 1)
                row["manifest_parse"] = time.perf_counter() - start
                row["manifest_bytes"] = len(data)
                row["manifest_tensors"] = len(parsed.tensors)
                del parsed, data
                row["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            del live, state2
            rows.append(row)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


def rank0_cpu(world: int, args: argparse.Namespace, base: str) -> dict[str, Any]:
    """Rank 0's decode + merge + encode of ``world`` parts of one rank's real part, in CPU seconds."""
    from pathlib import Path

    import tiersave
    from tiersave.collective import merge_parts, rank_part
    from tiersave.dist.wire import decode_json, encode_json
    from tiersave.format.layout import MANIFEST_NAME, step_dirname
    from tiersave.format.manifest import Manifest

    root = Path(base) / f"single-{world}"  # one per world size: a step is never overwritten
    with tiersave.Checkpointer(root, event_log=False, handle_sigterm=False) as ckpt:
        ckpt.save(1, moe_state(0, args.tensors_per_rank, int(args.tensor_kib * 1024), 1))
    m = Manifest.parse((root / step_dirname(1) / MANIFEST_NAME).read_bytes(), path="bench")
    one = json.dumps(decode_json(encode_json(rank_part(0, m.shards, m.tensors, m.tree))))
    payloads = []
    for r in range(world):  # rank r's part: the same tensors under its own shard files and names
        text = one.replace("shard-00000-", f"shard-{r:05d}-").replace("rank-00000/", f"rank-{r:05d}/")
        doc = json.loads(text)
        doc["rank"] = r
        payloads.append(encode_json({"ok": True, "doc": {"step": 1, "ok": True, "payload": doc, "error": None}}))
    start = time.process_time()
    parts = [decode_json(p)["doc"]["payload"] for p in payloads]  # type: ignore[index,call-overload]
    decoded = time.process_time()
    merged = merge_parts(1, parts, chunk_bytes=m.chunk_bytes, metrics={}, tags=(), metadata={}, stats={})
    done_merge = time.process_time()
    data = merged.to_json()
    end = time.process_time()
    parse = restore_parse_cpu(data, world, args.runs) if args.parse_cpu else {}
    return {
        **parse,
        "ranks": world,
        "tensors": len(merged.tensors),
        "manifest_bytes": len(data),
        "part_bytes": len(payloads[0]),
        "cpu_s": end - start,
        "decode_cpu_s": decoded - start,
        "merge_cpu_s": done_merge - decoded,
        "encode_cpu_s": end - done_merge,
    }


def restore_parse_cpu(data: bytes, world: int, runs: int) -> dict[str, Any]:
    """What rank 1 parses of the global manifest ``data`` at a restore, in CPU seconds, medians of ``runs``
    interleaved repetitions: the whole manifest then its part (``rank_view``), as every rank did before, and,
    where this tree has it, only its view (``Manifest.parse(..., part=)``)."""
    import gc

    from tiersave import collective
    from tiersave.format.manifest import Manifest

    part = getattr(collective, "view_part", lambda rank, world: None)(1, world)
    whole: list[float] = []
    view: list[float] = []
    for _ in range(runs):
        for kind, times in (("whole", whole), ("view", view)):
            if kind == "view" and part is None:
                continue
            gc.collect()
            start = time.process_time()
            parsed = Manifest.parse(data, path="bench", part=part) if kind == "view" else Manifest.parse(data, path="b")
            collective.rank_view(parsed, 1, world)
            times.append(time.process_time() - start)
            del parsed
    out = {"parse_whole_cpu_s": statistics.median(whole)}
    if view:
        out["parse_view_cpu_s"] = statistics.median(view)
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _median(rows: list[dict[str, Any]], key: str, sub: str | None = None) -> float:
    values = [(r[key].get(sub, float("nan")) if sub else r[key]) for r in rows]
    return statistics.median(values) if values else float("nan")


def summarize(world: int, by_rank: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over the runs: the slowest rank's times, rank 0's vote split against the others' wait."""
    runs = len(by_rank[0])

    def slowest(key: str) -> float:
        return statistics.median(max(by_rank[r][i][key] for r in by_rank) for i in range(runs))

    def others_wait(kind: str) -> float:
        return statistics.median(
            max(by_rank[r][i][kind].get("wait_s", 0.0) for r in by_rank if r != 0) for i in range(runs)
        )

    r0 = by_rank[0]
    return {
        "ranks": world,
        "tensors_per_rank": r0[0]["tensors"],
        "runs": runs,
        "save_s": slowest("save"),
        "async_blocked_s": slowest("async_blocked"),
        "async_total_s": slowest("async_total"),
        "restore_s": slowest("restore"),
        "restore_cpu_s": {r: _median(by_rank[r], "restore_cpu") for r in by_rank},
        "bit_exact": all(row["bit_exact"] for rows in by_rank.values() for row in rows),
        "manifest_bytes": _median(r0, "manifest_bytes"),
        "manifest_parse_s": _median(r0, "manifest_parse"),
        "manifest_tensors": r0[0]["manifest_tensors"],
        "rank0_maxrss_mib": max(row["maxrss_mib"] for row in r0),
        "rank0_vote": {
            k: statistics.median(row["save_vote"].get(k, float("nan")) for row in r0)
            for k in ("part_s", "gather_s", "decide_s", "merge_s", "encode_s", "write_s", "reply_s", "bytes_in")
        },
        "rank0_async_vote": {
            k: statistics.median(row["async_vote"].get(k, float("nan")) for row in r0)
            for k in ("part_s", "gather_s", "decide_s", "merge_s", "encode_s", "write_s")
        },
        "others_wait_s": others_wait("save_vote") if world > 1 else 0.0,
        "others_async_wait_s": others_wait("async_vote") if world > 1 else 0.0,
        "others_part_s": statistics.median(
            max(by_rank[r][i]["save_vote"].get("part_s", 0.0) for r in by_rank if r != 0) for i in range(runs)
        )
        if world > 1
        else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="world sizes to run, in order")
    p.add_argument("--tensors-per-rank", type=int, default=50_000)
    p.add_argument("--tensor-kib", type=float, default=0.5, help="bytes per tensor, in KiB (0.25 to 1 fits)")
    p.add_argument("--runs", type=int, default=3, help="save + save_async + restore rounds per world size")
    p.add_argument("--dir", default=None, help="where the roots go (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write the summaries here")
    p.add_argument("--timeout", type=float, default=600.0, help="coordination_timeout_s of every rank")
    p.add_argument(
        "--profile-restore",
        default=None,
        metavar="DIR",
        help="profile every rank's restore (cProfile) into DIR/restore-<N>r-rank<R>-run<I>.prof",
    )
    p.add_argument("--rank0-cpu", action="store_true", help="only rank 0's commit path, in this process (CPU s)")
    p.add_argument(
        "--parse-cpu",
        action="store_true",
        help="with --rank0-cpu: also a rank's parse of the global manifest at a restore (CPU s, --runs reps)",
    )
    args = p.parse_args(argv)
    if any(n < 1 for n in args.ranks) or args.tensors_per_rank < 1 or args.tensor_kib <= 0 or args.runs < 1:
        p.error("--ranks, --tensors-per-rank, --tensor-kib and --runs must be positive")
    base = tempfile.mkdtemp(prefix="ranks-many-", dir=args.dir)
    print(f"load average {os.getloadavg()[0]:.1f} at the start; {os.cpu_count()} cpus; root under {base}", flush=True)
    summaries = []
    try:
        for world in args.ranks:
            from pathlib import Path

            if args.rank0_cpu:
                summaries.append(rank0_cpu(world, args, base))
                print(json.dumps(summaries[-1]), flush=True)
                continue

            args.root = os.path.join(base, f"root-{world}")
            args.root_path = Path(args.root)
            out = tempfile.mkdtemp(prefix=f"out-{world}-", dir=base)
            mp.start_processes(_rank, args=(world, args, _free_port(), out), nprocs=world, start_method="spawn")
            by_rank = {}
            for r in range(world):
                with open(os.path.join(out, f"rank{r}.json")) as f:
                    by_rank[r] = json.load(f)
            summary = summarize(world, by_rank)
            summary["load_average"] = os.getloadavg()[0]
            summaries.append(summary)
            print(json.dumps(summary), flush=True)
            shutil.rmtree(args.root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
