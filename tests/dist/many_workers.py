"""Rank programs for tests/dist/test_many_tensors.py: a collective Checkpointer whose ranks each hold
$TIERSAVE_TEST_TENSORS small tensors (an expert-parallel state: each rank's experts' weights and Adam moments,
plus a few replicated tensors), saved, saved asynchronously and restored. Not a test module."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ckpt_workers import error_record, run_rank

import tiersave
from tiersave.state import flatten

ROOT = Path(os.environ.get("TIERSAVE_TEST_ROOT", "/nonexistent"))
TENSORS = int(os.environ.get("TIERSAVE_TEST_TENSORS", "20000"))
TIMEOUT_S = float(os.environ.get("TIERSAVE_DIST_TIMEOUT", "120"))


def state(rank: int, step: int) -> dict[str, Any]:
    """About TENSORS tensors of this rank's own (mixed dtypes and sizes, a few empty) and a replicated part."""
    gen = torch.Generator().manual_seed(rank * 7919 + step)
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(TENSORS // 3):
        name = f"layers.{i // 96}.experts.{rank * 32 + (i // 3) % 32}.w{i % 3 + 1}.weight"
        numel = 64 + (i % 5) * 32 if i % 997 else 0
        model[name] = torch.randn(numel, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
        optim[name] = {"exp_avg": torch.randn(numel, generator=gen), "exp_avg_sq": torch.rand(numel, generator=gen)}
    shared_gen = torch.Generator().manual_seed(step)
    shared = {f"router.{j}": torch.randn(32, generator=shared_gen) for j in range(8)}
    return {"model": model, "optim": optim, "shared": shared, "data": {"rank": rank, "position": step}}


def tensors(s: dict[str, Any]) -> list[torch.Tensor]:
    out = [*s["model"].values(), *s["shared"].values()]
    for moments in s["optim"].values():
        out += [moments["exp_avg"], moments["exp_avg_sq"]]
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta, tb = tensors(a), tensors(b)
    exact = all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb, strict=True))
    return exact and a["data"] == b["data"]


def many_round_trip(rank: int, world: int, rec: dict[str, Any]) -> None:
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S, event_log=False) as ckpt:
        ckpt.save(1, state(rank, 1), replicated=["shared"])
        handle = ckpt.save_async(2, state(rank, 2), replicated=["shared"])
        rec["async_step"] = handle.result(TIMEOUT_S * 3).step
        rec["vote"] = handle.stats.extra.get("vote", {})
        live = state(rank, 0)
        ckpt.restore(into=live)
        rec["restored_2"] = same(live, state(rank, 2))
        rec["restored_1"] = same(ckpt.restore(1), state(rank, 1))
        rec["tensors"] = len(tensors(live))
        rec["flat"] = len(flatten(live).tensors)  # empty tensors are tied (one storage): fewer entries


def over_the_cap(rank: int, world: int, rec: dict[str, Any]) -> None:
    """The manifest cap lowered (as a job of many more ranks and tensors would meet it): the save fails on every
    rank before anything is committed, and the group stays usable for a smaller save."""
    from tiersave.format import layout, manifest

    cap = int(os.environ["TIERSAVE_TEST_CAP"])
    layout.MAX_MANIFEST_BYTES = manifest.MAX_MANIFEST_BYTES = cap  # type: ignore[misc]
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S, event_log=False) as ckpt:
        start = time.monotonic()
        try:
            ckpt.save(1, state(rank, 1), replicated=["shared"])
            rec["save1"] = "committed"
        except tiersave.TiersaveError as exc:
            rec["save1"] = error_record(exc, start)
            failure = getattr(exc, "failures", {}).get(0)
            rec["rank0_error"] = {"type": type(failure).__name__, "message": str(failure)}
        rec["latest"] = None if ckpt.latest() is None else ckpt.latest().step
        dist.barrier()
        rec["entries"] = sorted(p.name for p in ROOT.iterdir() if p.name != "lock" and not p.name.startswith("."))
        dist.barrier()
        small = {"w": torch.full((8,), float(rank))}
        ckpt.save(2, small)
        rec["after"] = ckpt.latest().step


def forged_row(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Step 2's committed manifest resealed with one of rank 0's rows moved past its shard's end: every rank
    parses only its own view of it (fresh Checkpointers: nothing cached from the save), yet rank 1, whose rows
    are intact, refuses the copy too (the table is checked whole), and every rank falls back to step 1."""
    import json
    import warnings

    from tiersave.format.layout import MANIFEST_NAME, step_dirname
    from tiersave.format.manifest import seal

    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S, event_log=False) as ckpt:
        ckpt.save(1, state(rank, 1), replicated=["shared"])
        ckpt.save(2, state(rank, 2), replicated=["shared"])
    dist.barrier()
    if rank == 0:
        path = ROOT / step_dirname(2) / MANIFEST_NAME
        doc = json.loads(path.read_bytes())
        rec["format_version"] = doc["format_version"]
        shared, suffixes = doc["table"]["names"]
        name = ""
        for i, (k, suffix) in enumerate(zip(shared, suffixes, strict=True)):
            name = name[:k] + suffix
            if name.startswith("rank-00000/model.") and i + 1 < len(shared):
                break
        rec["forged"] = name
        offsets = doc["table"]["offset"]  # 4 KiB units, each the delta to the row before
        offsets[i] += 1 << 20
        offsets[i + 1] -= 1 << 20
        path.chmod(0o644)
        path.write_bytes(seal(doc))
    dist.barrier()
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S, event_log=False) as ckpt:
        live = state(rank, 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt.restore(into=live)
        rec["restored_1"] = same(live, state(rank, 1))
        rec["report_step"] = ckpt.last_restore.step if ckpt.last_restore is not None else None
        rec["skipped"] = [[s, why] for s, why in ckpt.last_restore.skipped] if ckpt.last_restore else []
        rec["warnings"] = [str(w.message) for w in caught]


SCENARIOS = {f.__name__: f for f in (many_round_trip, over_the_cap, forged_row)}

if __name__ == "__main__":
    run_rank(SCENARIOS[sys.argv[1]])
