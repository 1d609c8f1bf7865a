"""The MoE-like save against the same bytes in a few large tensors: blocking saves only, one process.

``many_tensors.py --moe-mb`` measures save, ``save_async`` and restore of both states; this measures only the
blocking save (until durable), interleaved state by state with the order alternated every rep, and prints one
JSON line: per state the medians of wall time, the process's CPU time and the save's stage/write statistics,
the write requests the storage issued per save, and the ratio MoE / few-large. Meant to compare two versions
in the same minutes (each version's ``src/`` on ``PYTHONPATH``, alternately)::

    for i in 1 2; do for src in OLD/src src; do
        PYTHONPATH=$src .venv/bin/python benchmarks/moe_save.py --dir DIR --mb 1024 --reps 4
    done; done
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from many_tensors import few_state, moe_state

import tiersave


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a directory on the disk to measure")
    p.add_argument("--mb", type=int, default=1024)
    p.add_argument("--expert-mib", type=int, default=4)
    p.add_argument("--reps", type=int, default=4)
    args = p.parse_args()
    states = {"moe": moe_state(args.mb, args.expert_mib), "few": few_state(args.mb)}
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="moe-save-"))
    ckpts = {k: tiersave.Checkpointer(work / k, keep_last=1, event_log=False) for k in states}
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in states}
    load = [os.getloadavg()[0]]
    step = 0
    try:
        for rep in range(args.reps):
            for name in list(states) if rep % 2 == 0 else list(states)[::-1]:
                step += 1
                before = sum(s["calls"] for s in ckpts[name]._saver.storage.io_stats.to_json()["paths"].values())
                c0, t0 = time.process_time(), time.perf_counter()
                stats = ckpts[name].save(step, states[name]).stats
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                after = sum(s["calls"] for s in ckpts[name]._saver.storage.io_stats.to_json()["paths"].values())
                sample = {"wall": wall, "cpu": cpu, "stage": stats.stage_s, "write": stats.write_s}
                samples[name].append({**sample, "requests": after - before})
    finally:
        for ck in ckpts.values():
            ck.close()
        shutil.rmtree(work, ignore_errors=True)
    load.append(os.getloadavg()[0])
    med = {k: {f: round(statistics.median(s[f] for s in v), 3) for f in v[0]} for k, v in samples.items()}
    out = {
        "tiersave": str(Path(tiersave.__file__).parent),
        "load": load,
        "median": med,
        "walls": {k: [round(s["wall"], 3) for s in v] for k, v in samples.items()},
        "ratio": round(med["moe"]["wall"] / med["few"]["wall"], 3),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
