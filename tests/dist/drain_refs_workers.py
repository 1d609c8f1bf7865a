"""Rank programs for tests/dist/test_incremental_drain_dist.py: a collective Checkpointer whose later tier is
incremental (``Tier(..., incremental=True)``), in real processes (gloo on 127.0.0.1). Each rank saves the steps
``$STEPS`` into ``$TIERSAVE_TEST_ROOT`` -> ``$SECOND``, then restores every step of ``$SECOND`` alone, and writes
what it saw to ``$TIERSAVE_DIST_OUT/rank<R>.json`` (runner: ckpt_workers.run_rank). Not a test module."""

from __future__ import annotations

import os
import sys
from typing import Any

from ckpt_workers import ROOT, TIMEOUT_S, run_rank
from incremental_workers import lora, same

import tiersave


def drain_chain(rank: int, world: int, rec: dict[str, Any]) -> None:
    steps = [int(s) for s in os.environ["STEPS"].split(",")]
    second = os.environ["SECOND"]
    tiers = [tiersave.Tier(ROOT, name="first"), tiersave.Tier(second, name="second", incremental=True)]
    with tiersave.Checkpointer(tiers=tiers, incremental=True, coordination_timeout_s=TIMEOUT_S) as ckpt:
        for step in steps:
            ckpt.save(step, lora(rank, step)).result()
            ckpt.wait(60)
    with tiersave.Checkpointer(second, coordination_timeout_s=TIMEOUT_S) as reader:  # the later tier alone
        rec["kept"] = [info.step for info in reader.list()]
        rec["restored"] = {str(s): same(reader.restore(s), lora(rank, s)) for s in rec["kept"]}


SCENARIOS = {f.__name__: f for f in (drain_chain,)}


if __name__ == "__main__":
    run_rank(SCENARIOS[sys.argv[1]])
