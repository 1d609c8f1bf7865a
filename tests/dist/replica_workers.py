"""Rank programs for tests/dist/test_replicas.py: a collective Checkpointer whose memory tier has peer replicas,
each simulated node with its own memory directory (``TIERSAVE_SHM_DIR``) and ``GROUP_RANK``. Each rank plays
SCENARIO and writes what it saw to ``$TIERSAVE_DIST_OUT/rank<R>.json``. Not a test module."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

import tiersave

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_workers import run_rank

TIMEOUT_S = float(os.environ.get("TIERSAVE_DIST_TIMEOUT", "20"))
ROOT = Path(os.environ.get("TIERSAVE_TEST_ROOT", "/nonexistent"))
STEPS = int(os.environ.get("TIERSAVE_TEST_STEPS", "3"))
REPLICAS = int(os.environ.get("TIERSAVE_TEST_REPLICAS", "1"))
TAG = os.environ.get("TIERSAVE_TEST_TAG") or None  # restore: restore(tag=TAG)


def state(rank: int, step: int) -> dict[str, Any]:
    """Each rank's own state, different per rank and step (bit-exact comparison after restore)."""
    g = torch.Generator().manual_seed(rank * 7919 + step)
    return {
        "w": torch.randn(64 * 1024, generator=g),
        "b": torch.arange(rank + 3, dtype=torch.int64) * step,
        "data": {"rank": rank, "position": step * 10 + rank},
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["data"] == b["data"])


def memory() -> tiersave.Checkpointer:
    tier = tiersave.Tier("mem://run", replicas=REPLICAS, keep=2)
    return tiersave.Checkpointer(tiers=[tier], coordination_timeout_s=TIMEOUT_S)


def save(rank: int, rec: dict[str, Any]) -> None:
    """Save STEPS steps in memory with replicas (and every second one on the shared disk, as a second
    Checkpointer: the durable fallback), step 2 tagged ``best`` in its manifest and by the movable tag
    ``serving``; record what each replication reported on the node leaders."""
    rec["replicas"] = {}
    with memory() as ckpt, tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S) as durable:
        for step in range(1, STEPS + 1):
            handle = ckpt.save_async(step, state(rank, step), tags=["best"] if step == 2 else ())
            handle.result(60)
            if step % 2 == 0:
                durable.save(step, state(rank, step))
            if "memory.replica" in handle.tiers:
                try:
                    handle.tier_result("memory.replica", 60)
                    rec["replicas"][str(step)] = "ok"
                except tiersave.TiersaveError as exc:
                    rec["replicas"][str(step)] = f"{type(exc).__name__}: {exc}"
        ckpt.tag(2, "serving")  # a movable tag: a file in each node's memory, not replicated
        rec["blocked_s"] = handle.stats.blocked_s


def restore(rank: int, rec: dict[str, Any]) -> None:
    """Restore the newest step (or the one tagged TAG) from memory (a peer's replica where this node's memory is
    empty); if no copy in memory can be used, record why and restore from the durable Checkpointer."""
    live = state(rank, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memory() as ckpt:
            try:
                ckpt.restore(into=live, tag=TAG)
                report = ckpt.last_restore
                rec.update(step=report.step, source=report.source, tier=report.tier)
            except tiersave.TiersaveError as exc:
                rec["memory_error"] = f"{type(exc).__name__}: {exc}"
        if "memory_error" in rec:
            with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S) as durable:
                durable.restore(into=live)
                rec.update(step=durable.last_restore.step, source=durable.last_restore.source, tier="durable")
    rec["warnings"] = [str(w.message) for w in caught]
    rec["consistent"] = same(live, state(rank, rec["step"]))


def save_replicated(rank: int, rec: dict[str, Any]) -> None:
    """Declare replicated state while the memory tier is node-local: refused on every rank before any write."""
    with memory() as ckpt:
        try:
            ckpt.save(1, {"model": {"w": torch.ones(1024)}, "own": state(rank, 1)}, replicated=["model"])
            rec["saved"] = True
        except tiersave.TiersaveError as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"


SCENARIOS = {f.__name__: f for f in (save, restore, save_replicated)}


def main() -> None:
    run_rank(lambda rank, world, rec: SCENARIOS[sys.argv[1]](rank, rec))


if __name__ == "__main__":
    main()
