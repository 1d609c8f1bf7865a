"""Issue 13's incremental-save target on a LoRA-like state: bytes written and background time per save after
the first, and restore speed, with ``incremental=True`` against plain full saves, side by side in one run.
Incremental saves run once per content hash (``TIERSAVE_CONTENT_HASH``): SHA-256 and, where the ``blake3``
package is installed, BLAKE3.

The state: a frozen base (fp32 weights, ``--base-mb``) plus trained LoRA adapters and their two Adam moments
(``--adapter-mb`` in all); every save after the first changes the adapters and moments only. For each mode
(``full``, ``incremental``), reps interleaved, a fresh root gets ``--saves`` saves; reported are the medians
over reps of: bytes written per save after the first (shard bytes this save wrote, from its manifest), the
background time of those saves (start of the save to durable commit, less the caller's stall) and the CPU
time the process spent meanwhile (less sensitive to a loaded machine than the wall time), and the time
to restore the last checkpoint into new tensors with the page cache dropped first (``POSIX_FADV_DONTNEED``,
or ``drop_caches`` as root).

Usage::

    .venv/bin/python benchmarks/incremental.py --base-mb 1024 --adapter-mb 24 --saves 4 --reps 3 \
        --dir DIR --json benchmarks/results/incremental.json
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
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from memory_tier import evict

import tiersave
from tiersave import knobs
from tiersave.catalog import Catalog
from tiersave.storage import open_storage

MiB = 1 << 20


def lora_state(base_mb: int, adapter_mb: int) -> dict:
    """Frozen base layers of 16 MiB (fp32) and, per layer, LoRA A/B with two Adam moments each."""
    layers = max(1, base_mb // 16)
    per_layer = max(4096, adapter_mb * MiB // layers // 6 // 4)  # 6 adapter-sized fp32 tensors per layer
    g = torch.Generator().manual_seed(0)
    state: dict = {"model": {}, "optim": {}}
    for i in range(layers):
        state["model"][f"layers.{i}.weight"] = torch.randn(4 * MiB, generator=g)  # 16 MiB, frozen
        for name in ("lora_a", "lora_b"):
            state["model"][f"layers.{i}.{name}"] = torch.randn(per_layer, generator=g)
            state["optim"][f"layers.{i}.{name}.exp_avg"] = torch.zeros(per_layer)
            state["optim"][f"layers.{i}.{name}.exp_avg_sq"] = torch.zeros(per_layer)
    return state


def train_step(state: dict) -> None:
    for name, t in state["model"].items():
        if "lora" in name:
            t.add_(0.01)
    for t in state["optim"].values():
        t.add_(0.001)


def nbytes(state: dict) -> int:
    return sum(t.nbytes for part in state.values() for t in part.values())


def run(mode: str, state: dict, saves: int, workdir: Path) -> dict:
    """``mode``: ``full``, or ``incremental-HASH`` with HASH a ``TIERSAVE_CONTENT_HASH`` value."""
    root = workdir / f"{mode}-{uuid.uuid4().hex[:8]}"
    written, background, stall, cpu = [], [], [], []
    incremental = mode.startswith("incremental")
    try:
        with (
            knobs.override_content_hash(mode.split("-")[1] if incremental else "auto"),
            tiersave.Checkpointer(root, incremental=incremental, event_log=False) as ckpt,
        ):
            for step in range(1, saves + 1):
                train_step(state)
                handle = ckpt.save(step, state, blocking=False)
                cpu0 = time.process_time()  # the caller waits idle from here: what follows is the background's CPU
                handle.result()
                cpu_s = time.process_time() - cpu0
                if step > 1:
                    m = Catalog(open_storage(str(root))).manifest(step)
                    written.append(m.stored_bytes - m.referenced_bytes)
                    background.append(handle.stats.total_s - handle.stats.blocked_s)
                    stall.append(handle.stats.blocked_s)
                    cpu.append(cpu_s)
        how = evict(root)
        with tiersave.Checkpointer(root, event_log=False) as ckpt:
            t0 = time.perf_counter()
            ckpt.restore(saves)
            restore_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "written_bytes": statistics.median(written),
        "background_s": statistics.median(background),
        "stall_s": statistics.median(stall),
        "background_cpu_s": statistics.median(cpu),
        "restore_s": restore_s,
        "evict": how,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-mb", type=int, default=1024)
    p.add_argument("--adapter-mb", type=int, default=24)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--json", type=Path)
    p.add_argument("--no-sha256", action="store_true", help="skip the SHA-256 incremental mode (the slowest)")
    args = p.parse_args()
    state = lora_state(args.base_mb, args.adapter_mb)
    total = nbytes(state)
    frozen = sum(t.nbytes for k, t in state["model"].items() if "lora" not in k)
    modes = ["full"] if args.no_sha256 else ["full", "incremental-sha256"]
    try:
        import blake3  # noqa: F401
    except ImportError:
        print("blake3 is not installed: incremental saves with SHA-256 only")
    else:
        modes.append("incremental-blake3")
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.reps):  # interleaved: both modes see the same machine state
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            runs[mode].append(run(mode, state, args.saves, args.dir))
    summary = {}
    for mode in modes:
        summary[mode] = {
            key: statistics.median(r[key] for r in runs[mode])
            for key in ("written_bytes", "background_s", "background_cpu_s", "stall_s", "restore_s")
        }
    full = summary["full"]
    ratios = {
        mode: {
            key: summary[mode][f"{key}_bytes" if key == "written" else f"{key}_s"]
            / full[f"{key}_bytes" if key == "written" else f"{key}_s"]
            for key in ("written", "background", "restore")
        }
        for mode in modes[1:]
    }
    result = {
        "state_bytes": total,
        "frozen_fraction": frozen / total,
        "saves": args.saves,
        "reps": args.reps,
        "load_average_before": load_before,
        "load_average": os.getloadavg(),
        "summary": summary,
        "ratios_to_full": ratios,
        "runs": runs,
    }
    print(f"state {total / MiB:.0f} MiB, {100 * frozen / total:.1f}% frozen; medians of {args.reps} reps")
    print(f"{'mode':<20} {'written/save':>14} {'background s':>13} {'its CPU s':>10} {'stall s':>8} {'restore s':>10}")
    for mode in modes:
        s = summary[mode]
        print(
            f"{mode:<20} {s['written_bytes'] / MiB:>10.1f} MiB {s['background_s']:>13.3f} "
            f"{s['background_cpu_s']:>10.3f} {s['stall_s']:>8.3f} {s['restore_s']:>10.3f}"
        )
    for mode, r in ratios.items():
        print(
            f"{mode} / full: written {r['written']:.3f}, background {r['background']:.3f}, restore {r['restore']:.3f}"
        )
    print(
        f"load average (1, 5, 15 min) before: {', '.join(f'{x:.1f}' for x in load_before)}; at the end: "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
