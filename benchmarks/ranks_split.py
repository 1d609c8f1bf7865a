"""Where a replicated ``save_async`` on several ranks blocks the caller: the layout, the copy and the rest.

Each of ``--ranks`` processes (gloo on 127.0.0.1) holds the same GPT-like state of ``--size`` bytes (``tiersave
bench``'s), declared ``replicated=["model"]``, and saves it ``--saves`` times; before each save, after a barrier,
it times one ``memmove`` per tensor of the bytes it writes itself into a buffer faulted in beforehand (the
floor of the staging copy, as ``tiersave bench --ranks N`` does). Each save after the first prints the blocked
time split by the save's own statistics: the layout (``stats.flatten_s``: flatten or the check against the
previous save's layout, selection, assignment, plan), the copy into the staging arena (``stats.stage_s``) and
the rest, and whether the layout was reused.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/ranks_split.py --ranks 4 --size 512MB --saves 6
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, root: str, size: int, saves: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import tiersave
    from tiersave.bench.workload import build_state, gpt_like_spec
    from tiersave.replicated import assign, select
    from tiersave.state import flatten

    state = {"model": build_state(gpt_like_spec("llama3-8b", size), seed=0)}
    owner = assign(select(state, flatten(state), ["model"]).tensors, world)
    own = [t for name, t in state["model"].items() if owner[f"model.{name}"] == rank]
    scratch = torch.empty(max(1, sum(t.nbytes for t in own)), dtype=torch.uint8)
    scratch.fill_(0)
    with tiersave.Checkpointer(root, keep_last=2, event_log=False, handle_sigterm=False) as ckpt:
        for step in range(1, saves + 1):
            dist.barrier()
            start = time.perf_counter()
            dst = scratch.data_ptr()
            for t in own:
                ctypes.memmove(dst, t.data_ptr(), t.nbytes)
                dst += t.nbytes
            memcpy = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            handle = ckpt.save_async(step, state, replicated=["model"])
            blocked = time.perf_counter() - start
            handle.result(300)
            st = handle.stats
            if step > 1:  # the first save allocates the arena and checks the declaration
                rest = blocked - st.flatten_s - st.stage_s
                print(
                    f"rank {rank} save {step}: memcpy {memcpy * 1e3:.1f} ms, blocked {blocked * 1e3:.1f} ms "
                    f"({blocked / memcpy:.2f}x) = layout {st.flatten_s * 1e3:.1f} + copy {st.stage_s * 1e3:.1f} "
                    f"+ rest {rest * 1e3:.1f}; layout reused: {st.extra.get('layout_reused')}",
                    flush=True,
                )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from tiersave.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--size", default="512MB")
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--port", type=int, default=29631)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="ranks-split-")
    print(f"load average {os.getloadavg()[0]:.1f} at the start; {os.cpu_count()} cpus", flush=True)
    try:
        mp.spawn(_rank, args=(args.ranks, root, parse_bytes(args.size), args.saves, args.port), nprocs=args.ranks)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
