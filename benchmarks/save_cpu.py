"""Wall time, CPU time and staging time of blocking saves (an MoE-like state, or with ``--gpt-gb`` the
`tiersave bench` state), for comparing two versions of the code.

Prints one line per save: ``LABEL wall_s cpu_s stage_s`` (CPU: ``os.times``, all threads). To compare the
code of two checkouts side by side, alternate processes so that both see the same load::

    for i in 1 2 3 4; do for src in /path/to/old/src src; do
        PYTHONPATH=$src .venv/bin/python benchmarks/save_cpu.py --label $src --dir /tmp/tiersave-cpu
    done; done

and take the medians per label.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from many_tensors import moe_state

from tiersave import Checkpointer


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="directory on the file system to measure")
    p.add_argument("--label", default="run")
    p.add_argument("--moe-mb", type=int, default=1536, help="state size in MiB")
    p.add_argument("--expert-mib", type=int, default=4, help="MiB per expert tensor")
    p.add_argument("--gpt-gb", type=float, default=0.0, help="save the `tiersave bench` state of this size instead")
    p.add_argument("--saves", type=int, default=3)
    args = p.parse_args()
    root = Path(args.dir) / f"save-cpu-{os.getpid()}"
    root.mkdir(parents=True)
    if args.gpt_gb:
        from tiersave.bench.workload import build_state, gpt_like_spec

        state = build_state(gpt_like_spec("llama3-8b", int(args.gpt_gb * 1e9)))
    else:
        state = moe_state(args.moe_mb, args.expert_mib)
    try:
        with Checkpointer(root, keep_last=2, event_log=False, handle_sigterm=False) as ck:
            ck.save(0, state)  # warm: the staging arena and the I/O calibration exist from here on
            for step in range(1, args.saves + 1):
                c0, t0 = _cpu(), time.perf_counter()
                handle = ck.save(step, state)
                wall, cpu = time.perf_counter() - t0, _cpu() - c0
                print(f"{args.label} {wall:.3f} {cpu:.3f} {handle.stats.stage_s:.3f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
