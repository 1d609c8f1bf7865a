"""Rank programs for tests/dist/test_writer_lock_dist.py: the writer lock of a collective Checkpointer, in real
processes (gloo on 127.0.0.1). Each rank writes what it saw to ``$TIERSAVE_DIST_OUT/rank<R>.json``. Not a test
module."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tiersave
from tiersave.errors import TiersaveError, WriterLockedError
from tiersave.storage.lock import LOCK_NAME, LockHolder
from tiersave.storage.posix import LocalStorage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_workers import run_rank

ROOT = Path(os.environ.get("TIERSAVE_TEST_ROOT", "/nonexistent"))


def pids(world: int) -> list[int]:
    """Every rank's pid (a tensor all-gather: nothing is pickled)."""
    mine = torch.tensor([os.getpid()], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(out, mine)
    return [int(t.item()) for t in out]


def rank0_holds(rank: int, world: int, rec: dict[str, Any]) -> None:
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=20) as ckpt:
        ckpt.save(1, {"w": torch.full((16,), float(rank))})  # every rank saves; only rank 0 may hold the lock
        rec["pids"] = pids(world)
        holder = LockHolder.parse((ROOT / LOCK_NAME).read_bytes())
        rec["holder_pid"] = holder.pid if holder is not None else None
        if rank == 1:  # another writer in a rank's process is refused, naming rank 0
            try:
                LocalStorage(ROOT).writer_lock()
                rec["second"] = "taken"
            except WriterLockedError as exc:
                rec["second"] = str(exc)
        dist.barrier()
        ckpt.save(2, {"w": torch.full((16,), float(rank))})
    dist.barrier()
    rec["after_close"] = (ROOT / LOCK_NAME).read_bytes().decode()


def refused(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Another process holds the root: rank 0's save is refused, and every rank learns it from the vote."""
    start = time.monotonic()
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=60) as ckpt:
        try:
            ckpt.save(1, {"w": torch.full((16,), float(rank))})
            rec["saved"] = True
        except TiersaveError as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["elapsed"] = time.monotonic() - start
        rec["steps"] = [i.step for i in ckpt.list()]


def main() -> None:
    run_rank({"rank0_holds": rank0_holds, "refused": refused}[sys.argv[1]])


if __name__ == "__main__":
    main()
