"""Per-tensor cost of DCP beside tiersave's: many small tensors saved and loaded, one process.

For each count of ``--kib`` KiB fp32 tensors, interleaved over ``--runs`` runs (order rotated), a blocking
save until durable and a load into the live state, by:

- ``tiersave``: ``Checkpointer.save`` / ``restore(into=state)``;
- ``dcp+tiersave``: ``dcp.save`` / ``dcp.load`` through ``tiersave.dcp.Writer`` / ``Reader``;
- ``dcp``: ``dcp.save`` / ``dcp.load`` through DCP's own ``FileSystemWriter`` / ``FileSystemReader``.

DCP plans, pickles metadata and issues one write item per tensor whatever its size, so at many small tensors
its cost is per tensor, not per byte. Prints the medians in ms and us per tensor; ``--json`` writes them.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/dcp_many_tensors.py --dir DIR --counts 1000 20000 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import tiersave
from tiersave.dcp import Reader, Writer


def _state(count: int, kib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(count)
    return {f"layers.{i}.weight": torch.rand(kib * 256, generator=g) for i in range(count)}


def _methods(root: Path) -> dict[str, tuple[Callable[[int, dict[str, torch.Tensor]], None], Callable[..., None]]]:
    def ts_save(step: int, state: dict[str, torch.Tensor]) -> None:
        with tiersave.Checkpointer(str(root / "ts"), keep_last=1, event_log=False) as ckpt:
            ckpt.save(step, state)

    def ts_load(step: int, state: dict[str, torch.Tensor]) -> None:
        with tiersave.Checkpointer(str(root / "ts"), event_log=False) as ckpt:
            ckpt.restore(step, into=state)

    def dts_save(step: int, state: dict[str, torch.Tensor]) -> None:
        dcp.save(state, storage_writer=Writer(str(root / "dts"), step=step))

    def dts_load(step: int, state: dict[str, torch.Tensor]) -> None:
        dcp.load(state, storage_reader=Reader(str(root / "dts"), step=step))

    def dcp_save(step: int, state: dict[str, torch.Tensor]) -> None:
        path = root / "dcp" / str(step)
        shutil.rmtree(path, ignore_errors=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True))

    def dcp_load(step: int, state: dict[str, torch.Tensor]) -> None:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(root / "dcp" / str(step))))

    return {"tiersave": (ts_save, ts_load), "dcp+tiersave": (dts_save, dts_load), "dcp": (dcp_save, dcp_load)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="where to write (removed and recreated)")
    p.add_argument("--counts", type=int, nargs="+", default=[1000, 20000])
    p.add_argument("--kib", type=int, default=1, help="size of each tensor in KiB (default 1)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", help="write the results to this file")
    args = p.parse_args()
    warnings.filterwarnings("ignore")  # DCP warns that no process group is initialized: one process here
    results: dict[str, dict[str, dict[str, float]]] = {}
    for count in args.counts:
        root = Path(args.dir) / f"n{count}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        state = _state(count, args.kib)
        methods = _methods(root)
        names = list(methods)
        times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in names}
        for run in range(args.runs):
            order = names[run % len(names) :] + names[: run % len(names)]
            for name in order:
                save, load = methods[name]
                step = run + 1
                t0 = time.perf_counter()
                save(step, state)
                t1 = time.perf_counter()
                load(step, state)
                t2 = time.perf_counter()
                times[name]["save"].append(t1 - t0)
                times[name]["load"].append(t2 - t1)
        results[str(count)] = {}
        for name in names:
            med = {op: statistics.median(v) for op, v in times[name].items()}
            results[str(count)][name] = {f"{op}_ms": round(s * 1e3, 1) for op, s in med.items()} | {
                f"{op}_us_per_tensor": round(s * 1e6 / count, 2) for op, s in med.items()
            }
            r = results[str(count)][name]
            print(
                f"{count:>7} x {args.kib} KiB  {name:<13} save {r['save_ms']:>8.1f} ms "
                f"({r['save_us_per_tensor']:6.1f} us/tensor)  load {r['load_ms']:>8.1f} ms "
                f"({r['load_us_per_tensor']:6.1f} us/tensor)",
                flush=True,
            )
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"kib": args.kib, "runs": args.runs, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
