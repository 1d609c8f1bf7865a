"""Rank programs for tests/dist/test_incremental_dist.py: incremental saves of a collective Checkpointer in
real processes (gloo on 127.0.0.1). Each rank plays SCENARIO against ``$TIERSAVE_TEST_ROOT`` and writes what it
saw to ``$TIERSAVE_DIST_OUT/rank<R>.json`` (runner: ckpt_workers.run_rank). Not a test module."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from ckpt_workers import ROOT, TIMEOUT_S, run_rank

import tiersave


def lora(rank: int, step: int) -> dict[str, Any]:
    """A rank's LoRA-like state at ``step``: a frozen base of 9 MiB (a shard of its own), different on every
    rank, and a small adapter and data position that change at every step."""
    g = torch.Generator().manual_seed(1000 + rank)
    return {
        "base": torch.randn(9 << 18, generator=g),
        "adapter": torch.full((4096,), float(rank * 100 + step)),
        "data": {"rank": rank, "position": step * 10 + rank},
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(
        torch.equal(a["base"], b["base"]) and torch.equal(a["adapter"], b["adapter"]) and a["data"] == b["data"]
    )


def chain(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Incremental saves of the steps in ``$STEPS`` (``keep_last=$KEEP``), then the steps ``$RESTORE`` restored
    (a list of them: rank 0 deletes as it commits, so another rank's listing may still show a deleted step)."""
    steps = [int(s) for s in os.environ["STEPS"].split(",")]
    keep = int(os.environ.get("KEEP", "0")) or None
    with tiersave.Checkpointer(ROOT, incremental=True, keep_last=keep, coordination_timeout_s=TIMEOUT_S) as ckpt:
        for step in steps:
            handle = ckpt.save(step, lora(rank, step))
            rec.setdefault("referenced", {})[str(step)] = handle.stats.extra.get("referenced_bytes", 0)
        rec["kept"] = [info.step for info in ckpt.list()]
        restore = [int(s) for s in os.environ["RESTORE"].split(",")]
        rec["restored"] = {str(step): same(ckpt.restore(step), lora(rank, step)) for step in restore}


def turns(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Two tensors of 9 MiB (a shard each, different on every rank) changed in turn at every save, so each
    save references the other one in the save before and keeping a step keeps the chain; no ``full_every``.
    Records which saves referenced nothing (full), the steps listed after each save, and those at the end."""
    from tiersave.references import MAX_KEPT_BY_REFERENCES

    x, y = torch.full((9 << 18,), float(rank)), torch.full((9 << 18,), float(-rank))
    with tiersave.Checkpointer(ROOT, incremental=True, keep_last=2, coordination_timeout_s=TIMEOUT_S) as ckpt:
        for step in range(1, 3 * MAX_KEPT_BY_REFERENCES):
            (x if step % 2 else y).add_(1)
            handle = ckpt.save(step, {"x": x, "y": y})
            if not handle.stats.extra.get("referenced_bytes", 0):
                rec.setdefault("full", []).append(step)
            rec.setdefault("listed", []).append(len(ckpt.list()))  # blocking: after rank 0's retention of it
        rec["kept"] = [info.step for info in ckpt.list()]
        last = rec["kept"][-1]
        out = ckpt.restore(last)
        rec["restored"] = bool(torch.equal(out["x"], x) and torch.equal(out["y"], y))


def one_rank_fails_staging(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Steps 1-2 saved (2 references 1); rank 1's staging of step 3 fails (an injected error), so every rank's
    save of step 3 fails; then steps 4 and 5. Records, per step, the bytes referenced or the error."""
    from tiersave.engine.pipeline import StagedWrite

    real_stage = StagedWrite.stage

    def stage(self: StagedWrite, *args: Any, **kwargs: Any) -> None:
        if rank == 1 and rec.get("step") == 3:
            raise RuntimeError("injected: rank 1 cannot stage step 3")
        real_stage(self, *args, **kwargs)

    StagedWrite.stage = stage  # type: ignore[method-assign]
    with tiersave.Checkpointer(ROOT, incremental=True, coordination_timeout_s=TIMEOUT_S) as ckpt:
        for step in (1, 2, 3, 4, 5):
            rec["step"] = step
            try:
                handle = ckpt.save(step, lora(rank, step))
            except Exception as exc:
                rec.setdefault("failed", {})[str(step)] = f"{type(exc).__name__}: {exc}"
                continue
            rec.setdefault("referenced", {})[str(step)] = handle.stats.extra.get("referenced_bytes", 0)
        rec["restored"] = {str(step): same(ckpt.restore(step), lora(rank, step)) for step in (4, 5)}


SCENARIOS = {f.__name__: f for f in (chain, turns, one_rank_fails_staging)}


if __name__ == "__main__":
    run_rank(SCENARIOS[sys.argv[1]])
