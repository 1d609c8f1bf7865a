"""Rank programs for tests/dist/test_partial_loads.py: partial and transfer-learning restores through a
collective ``tiersave.Checkpointer`` in real processes (gloo on 127.0.0.1). Each rank writes what it saw to
``$TIERSAVE_DIST_OUT/rank<R>.json``. Not a test module."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

import tiersave

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_workers import run_rank

TIMEOUT_S = float(os.environ.get("TIERSAVE_DIST_TIMEOUT", "10"))
ROOT = Path(os.environ.get("TIERSAVE_TEST_ROOT", "/nonexistent"))


def model(rank: int, classes: int) -> torch.nn.Module:
    torch.manual_seed(rank)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, classes))


def partial(rank: int, world: int, rec: dict[str, Any]) -> None:
    saved = model(rank, 10)
    extra = torch.full((512, 512), float(rank))
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S) as ckpt:
        ckpt.save(1, {"model": saved, "optim": torch.optim.Adam(saved.parameters()), "extra": extra})
        # Each rank its own subset, in one collective restore.
        if rank % 2 == 0:
            fresh = model(100 + rank, 10)
            into = {"model": fresh}
            ckpt.restore(into=into)
            rec["subset_ok"] = list(into) == ["model"] and all(
                torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), saved.state_dict().values())
            )
            rec["subset_expected"] = sum(t.nbytes for t in saved.state_dict().values())
        else:
            out = ckpt.restore(keys=["extra"])
            rec["subset_ok"] = list(out) == ["extra"] and torch.equal(out["extra"], extra)
            rec["subset_expected"] = extra.nbytes
        rec["subset_read"] = ckpt.last_restore.bytes_read
        # Transfer learning: a new head of another size on every rank.
        new = model(200 + rank, 3)
        ckpt.restore(into={"model": new}, strict=False)
        report = ckpt.last_restore
        rec["body_ok"] = torch.equal(new[0].weight, saved[0].weight)
        rec["mismatched"] = report.mismatched
        rec["tl_read"] = report.bytes_read
        rec["tl_expected"] = saved[0].weight.nbytes + saved[0].bias.nbytes


def main() -> None:
    run_rank({"partial": partial}[sys.argv[1]])


if __name__ == "__main__":
    main()
