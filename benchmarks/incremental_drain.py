"""Incremental drains (``Tier(..., incremental=True)``) against plain drains, side by side in one run: bytes
written on the later tier and drain time per drain after the first, on a LoRA-like state.

The chain: ``mem://`` (incremental saves, so every shard carries content hashes) -> a later tier, either a
local directory or an S3 bucket on a throwaway SeaweedFS server on loopback (``--tier s3``; drains there are
zstd-compressed with ``--compress zstd``). The state is ``benchmarks/incremental.py``'s: a frozen fp32 base
(``--base-mb``) plus LoRA adapters and their Adam moments (``--adapter-mb``), of which every save after the
first changes the adapters and moments only. For each mode (``plain``: the later tier copies every byte;
``incremental``: it references the unchanged shards), reps interleaved, a fresh chain gets ``--saves`` saves,
each followed by waiting for its drain. Reported, as the median over reps of each rep's median over the drains
after the first: the shard bytes the drain wrote on the later tier (its files, compressed when compressed) and
the drain's time (``total_s`` of its ``drained`` event: the copy, the check of its references, the commit).
Every checkpoint of the later tier is restored and compared with what was saved at the end of each rep.

Usage::

    .venv/bin/python benchmarks/incremental_drain.py --base-mb 256 --adapter-mb 8 --saves 4 --reps 3 \
        --tier local --dir DIR
    .venv/bin/python benchmarks/incremental_drain.py --tier s3 --compress zstd --reps 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from incremental import lora_state, nbytes, train_step

import tiersave
from tiersave.catalog import Catalog
from tiersave.events import EVENTS_NAME
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage

MiB = 1 << 20


def clone(state: dict) -> dict:
    return {part: {k: v.clone() for k, v in tensors.items()} for part, tensors in state.items()}


def run(mode: str, state: dict, saves: int, later: Any, compress: str | None, events_dir: Path) -> dict:
    mem = MemoryStorage(f"bench-drain-{uuid.uuid4().hex[:8]}")
    events_dir.mkdir(parents=True)
    saved = {}
    try:
        tiers = [
            tiersave.Tier(mem, name="mem", keep=2),
            tiersave.Tier(events_dir, name="events", every=10**9),  # never drained: holds the event log only
            tiersave.Tier(later, name="later", incremental=mode == "incremental", compress=compress),
        ]
        with tiersave.Checkpointer(tiers=tiers, incremental=True) as ckpt:
            for step in range(1, saves + 1):
                if step > 1:
                    train_step(state)
                ckpt.save(step, state).result()
                assert ckpt.wait(600), "a drain did not finish in 10 minutes"
                saved[step] = clone(state)
        drains = [
            json.loads(line)
            for line in (events_dir / EVENTS_NAME).read_text().splitlines()
            if '"drained"' in line and '"later"' in line
        ]
        drains.sort(key=lambda e: e["step"])
        assert [e["step"] for e in drains] == list(range(1, saves + 1)), drains
        catalog = Catalog(later)
        for step in catalog.steps():  # every kept step of the later tier, bit for bit
            with tiersave.Checkpointer(later) as reader:
                got = reader.restore(step)
            for part, tensors in saved[step].items():
                assert all(torch.equal(got[part][k], v) for k, v in tensors.items()), (mode, step)
        after = drains[1:]
        return {
            "first_bytes": drains[0]["file_bytes"],
            "bytes": statistics.median(e["file_bytes"] for e in after),
            "seconds": statistics.median(e["total_s"] for e in after),
            "first_seconds": drains[0]["total_s"],
        }
    finally:
        shutil.rmtree(mem.root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-mb", type=int, default=256)
    parser.add_argument("--adapter-mb", type=int, default=8)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tier", choices=("local", "s3"), default="local")
    parser.add_argument("--compress", choices=("zstd",), default=None)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tiersave-bench-drain-", dir=args.dir))
    server = None
    if args.tier == "s3":
        from tiersave.testing.seaweed import SeaweedServer

        server = SeaweedServer(work / "weed")
        server.start()
    results: dict[str, list[dict]] = {"plain": [], "incremental": []}
    state0 = lora_state(args.base_mb, args.adapter_mb)
    total = nbytes(state0)
    try:
        for rep in range(args.reps):
            modes = ["plain", "incremental"] if rep % 2 == 0 else ["incremental", "plain"]
            for mode in modes:
                name = f"{mode}-{rep}"
                later = server.storage("bench", name) if server is not None else LocalStorage(work / name)
                out = run(mode, clone(state0), args.saves, later, args.compress, work / f"events-{name}")
                results[mode].append(out)
                print(f"rep {rep} {mode}: {json.dumps(out)}", file=sys.stderr)
                if server is None:
                    shutil.rmtree(work / name, ignore_errors=True)
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)

    summary = {
        mode: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for mode, runs in results.items()
    }
    plain, inc = summary["plain"], summary["incremental"]
    where = f"{args.tier}{' (zstd)' if args.compress else ''}"
    print(
        f"state {total / MiB:.0f} MiB (base {args.base_mb} MiB frozen, adapters+moments {args.adapter_mb} MiB), "
        f"later tier {where}, {args.saves} saves, median of {args.reps} reps"
    )
    print("| drains after the first | plain | incremental | incremental/plain |")
    print("| --- | --- | --- | --- |")
    print(
        f"| bytes written per drain | {plain['bytes'] / MiB:.1f} MiB | {inc['bytes'] / MiB:.1f} MiB | "
        f"{inc['bytes'] / max(1, plain['bytes']):.3f} |"
    )
    print(
        f"| drain time | {plain['seconds']:.3f} s | {inc['seconds']:.3f} s | "
        f"{inc['seconds'] / max(1e-9, plain['seconds']):.3f} |"
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}, indent=1)
        )


if __name__ == "__main__":
    main()
