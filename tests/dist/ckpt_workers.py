"""Rank programs for tests/dist/test_collective_checkpointer.py: a collective ``tiersave.Checkpointer`` in real
processes (gloo on 127.0.0.1). Each rank joins through torchrun's environment, plays SCENARIO against the root
``$TIERSAVE_TEST_ROOT`` and writes what it saw to ``$TIERSAVE_DIST_OUT/rank<R>.json``. Not a test module."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tiersave
from tiersave.errors import DistributedCheckpointError
from tiersave.format.layout import step_dirname
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import Fault, FaultyStorage

TIMEOUT_S = float(os.environ.get("TIERSAVE_DIST_TIMEOUT", "10"))
ROOT = Path(os.environ.get("TIERSAVE_TEST_ROOT", "/nonexistent"))


def state(rank: int, step: int) -> dict[str, Any]:
    """Each rank's own state: different tensors per rank, a data position, a shape that differs by rank."""
    return {
        "w": torch.full((2048,), float(rank * 1000 + step)),
        "b": torch.arange(rank + 3, dtype=torch.int64) * step,
        "data": {"rank": rank, "position": step * 10 + rank},
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["data"] == b["data"])


def error_record(exc: BaseException, start: float) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    if isinstance(exc, DistributedCheckpointError):
        out["failures"] = {str(r): type(e).__name__ for r, e in exc.failures.items()}
    return out


def save_restore(rank: int, world: int, rec: dict[str, Any]) -> None:
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S) as ckpt:
        ckpt.save(1, state(rank, 1))
        handle = ckpt.save_async(2, state(rank, 2))
        rec["async_step"] = handle.result(60).step
        rec["latest"] = ckpt.latest().step
        live = state(rank, 0)
        ckpt.restore(into=live)
        rec["restored_latest"] = same(live, state(rank, 2))
        rec["restored_1"] = same(ckpt.restore(1), state(rank, 1))
        rec["tensors_bytes_read"] = ckpt.last_restore.bytes_read
        rec["identity"] = {"node": int(os.environ.get("GROUP_RANK", "0")), "local": int(os.environ["LOCAL_RANK"])}


def rank_fails(rank: int, world: int, rec: dict[str, Any]) -> None:
    storage: Any = LocalStorage(ROOT)
    if rank == 1:
        storage = FaultyStorage(storage)
    with tiersave.Checkpointer(storage, coordination_timeout_s=TIMEOUT_S) as ckpt:
        ckpt.save(1, state(rank, 1))
        if rank == 1:  # its next write fails with "no space left"
            storage.faults = [Fault("write_at", storage.ops["write_at"] + 1, lambda: OSError(errno.ENOSPC, "injected"))]
        start = time.monotonic()
        try:
            ckpt.save(2, state(rank, 2))
            rec["save2"] = "committed"
        except tiersave.TiersaveError as exc:  # the failing rank may get its own error first-hand
            rec["save2"] = error_record(exc, start)
        rec["latest_after_failure"] = ckpt.latest().step
        dist.barrier()
        rec["leftovers"] = sorted(p.name for p in ROOT.iterdir() if ".tmp-" in p.name)
        dist.barrier()  # every rank has looked before any starts the retry
        if rank == 1:
            storage.faults.clear()
        ckpt.save(2, state(rank, 2))  # the group is still usable after a clean failure
        rec["latest_after_retry"] = ckpt.latest().step


class _RemovedBeforeCommit(FaultyStorage):
    """Rank 0's root, where another process removes step 2's attempt directory once every rank has written its
    shards there, just before rank 0's commit looks at them (a clean-up or second job in the same root)."""

    def head(self, key: str) -> Any:
        name = key.split("/", 1)[0]
        if name.startswith(f"{step_dirname(2)}.tmp-") and (ROOT / name).is_dir():
            shutil.rmtree(ROOT / name)
        return super().head(key)


def attempt_removed(rank: int, world: int, rec: dict[str, Any]) -> None:
    storage: Any = LocalStorage(ROOT)
    if rank == 0:
        storage = _RemovedBeforeCommit(storage)
    with tiersave.Checkpointer(storage, coordination_timeout_s=TIMEOUT_S) as ckpt:
        ckpt.save(1, state(rank, 1))
        try:
            ckpt.save(2, state(rank, 2))
            rec["save2"] = "committed"
        except tiersave.TiersaveError as exc:
            rec["save2"] = error_record(exc, time.monotonic())
        rec["latest"] = ckpt.latest().step


def rank_dies(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Rank 1 is launched with TIERSAVE_CRASHPOINT set: it dies with SIGKILL inside its second save."""
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S) as ckpt:
        ckpt.save(1, state(rank, 1))
        start = time.monotonic()
        try:
            ckpt.save(2, state(rank, 2))
            rec["save2"] = "committed"
        except DistributedCheckpointError as exc:
            rec["save2"] = error_record(exc, start)
        rec["latest"] = ckpt.latest().step
        ckpt.close(timeout=5)
    rec["exit_now"] = True  # the job's group is broken: do not wait on it at exit


def save_loop(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Save step after step until killed; record each step acknowledged."""
    path = Path(os.environ["TIERSAVE_DIST_OUT"]) / f"acked{rank}.txt"
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S, keep_last=3) as ckpt, open(path, "a") as acked:
        step = (ckpt.latest().step if ckpt.latest() is not None else 0) + 1
        while True:
            ckpt.save(step, state(rank, step))
            acked.write(f"{step}\n")
            acked.flush()
            step += 1


def restore_check(rank: int, world: int, rec: dict[str, Any]) -> None:
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S) as ckpt:
        live = state(rank, 0)
        ckpt.restore(into=live)
        step = ckpt.last_restore.step
        rec["step"] = step
        rec["consistent"] = same(live, state(rank, step))


def world_restore(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Restore with another number of ranks than saved: a clear error on every rank."""
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S) as ckpt:
        try:
            ckpt.restore()
            rec["restore"] = "ok"
        except tiersave.TiersaveError as exc:
            rec["restore"] = error_record(exc, time.monotonic())


SCENARIOS = {
    f.__name__: f
    for f in (save_restore, rank_fails, rank_dies, save_loop, restore_check, world_restore, attempt_removed)
}


def run_rank(scenario: Callable[[int, int, dict[str, Any]], None]) -> None:
    """One rank of a test job: join the gloo group, play ``scenario``, and write what it saw (or how it crashed)
    to ``$TIERSAVE_DIST_OUT/rank<R>.json`` atomically, even when it raised. Shared by every worker module."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rec: dict[str, Any] = {"rank": rank}
    start = time.monotonic()
    try:
        scenario(rank, world, rec)
    except BaseException as exc:
        rec["crash"] = error_record(exc, start)
        raise
    finally:
        out = Path(os.environ["TIERSAVE_DIST_OUT"]) / f"rank{rank}.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, out)
    if rec.get("exit_now"):
        os._exit(0)
    dist.destroy_process_group()


def main() -> None:
    run_rank(SCENARIOS[sys.argv[1]])


if __name__ == "__main__":
    main()
