"""Rank programs for tests/dist/test_part_drains.py: a collective Checkpointer whose first tier is a memory tier on
two simulated nodes (each node's memory directory under ``$TIERSAVE_TEST_SHM/node<GROUP_RANK>``), with peer
replicas, and a later shared tier (``$TIERSAVE_TEST_LATER``: a local directory or an ``s3://`` URI) every second
save. Each rank plays SCENARIO and writes what it saw to ``$TIERSAVE_DIST_OUT/rank<R>.json``. Not a test module."""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Before tiersave opens a memory tier: each simulated node has its own memory (torchrun sets GROUP_RANK).
if "TIERSAVE_TEST_SHM" in os.environ:  # not when the test module imports state() from here
    os.environ["TIERSAVE_SHM_DIR"] = f"{os.environ['TIERSAVE_TEST_SHM']}/node{os.environ.get('GROUP_RANK', '0')}"
if os.environ.get("GROUP_RANK") == "1" and os.environ.get("TIERSAVE_TEST_NODE1_CRASH"):  # one node of two dies
    os.environ["TIERSAVE_CRASHPOINT"] = os.environ["TIERSAVE_TEST_NODE1_CRASH"]
if os.environ.get("GROUP_RANK") == "0" and os.environ.get("TIERSAVE_TEST_RANK0_CRASH"):  # rank 0's node dies
    os.environ["TIERSAVE_CRASHPOINT"] = os.environ["TIERSAVE_TEST_RANK0_CRASH"]

from ckpt_workers import run_rank
from replica_workers import same, state

import tiersave
from tiersave import partdrain
from tiersave.errors import TransientStorageError

TIMEOUT_S = float(os.environ.get("TIERSAVE_DIST_TIMEOUT", "10"))
LATER = os.environ.get("TIERSAVE_TEST_LATER", "/nonexistent")
STEPS = int(os.environ.get("TIERSAVE_TEST_STEPS", "4"))


EVERY = int(os.environ.get("TIERSAVE_TEST_EVERY", "2"))


def checkpointer() -> tiersave.Checkpointer:
    tiers = [tiersave.Tier("mem://run", replicas=1, keep=2), tiersave.Tier(LATER, name="durable", every=EVERY, keep=2)]
    return tiersave.Checkpointer(tiers=tiers, coordination_timeout_s=TIMEOUT_S)


def saves(ckpt: tiersave.Checkpointer, rank: int, rec: dict[str, Any]) -> None:
    """Save STEPS steps; on node leaders, record what each drain to the later tier reported (its future) and,
    for a failed one, how long it took to learn of it."""
    rec["drains"] = {}
    for step in range(1, STEPS + 1):
        handle = ckpt.save_async(step, state(rank, step))
        handle.result(60)
        if "durable" in handle.tiers:
            started = time.monotonic()
            try:
                info = handle.tier_result("durable", 120)
                rec["drains"][str(step)] = "ok" if info is None else f"committed {info.step}"
                # and the drain's follow-up (rank 0's retention on the tier, which a slow S3 listing makes
                # last): else the next due step finds the tier busy and is skipped, which these tests do not test
                ckpt.wait(120, raise_errors=False)
            except tiersave.TiersaveError as exc:
                rec["drains"][str(step)] = f"{type(exc).__name__}: {exc}"
                rec["error_after_s"] = time.monotonic() - started


def inject_faults() -> None:
    """Faults of the drains, in this process (the code under test is unchanged otherwise).

    TIERSAVE_TEST_RANK0_PREFIX_FAIL=S: rank 0 fails the drain of step S before it derives the attempt's prefix
    (the tier did not answer), while node 1 copies its part there all the same.
    TIERSAVE_TEST_NODE1_LOSE=S:how: node 1 writes its part of step S, then, before its record, one of its shards
    is lost (``delete``) or cut short by a byte (``truncate``, a local tier): the record's sizes are a lie."""
    fail = os.environ.get("TIERSAVE_TEST_RANK0_PREFIX_FAIL")
    if fail and os.environ.get("GROUP_RANK") == "0":
        derive = partdrain.PartDrains._prefix

        def failing(self: Any, tier: Any, step: int) -> str:
            if step == int(fail):
                raise TransientStorageError(f"injected: the tier did not answer for step {step}")
            return derive(self, tier, step)

        partdrain.PartDrains._prefix = failing  # type: ignore[method-assign]
    lose = os.environ.get("TIERSAVE_TEST_NODE1_LOSE")
    if lose and os.environ.get("GROUP_RANK") == "1":
        lose_step, _, how = lose.partition(":")
        put = partdrain.PartDrains._put

        def losing(self: Any, tier: Any, prefix: str, record: dict[str, Any]) -> None:
            if record.get("step") == int(lose_step) and "shards" in record:
                name = sorted(record["shards"])[0]
                if how == "truncate":
                    path = Path(tier.storage.root) / prefix / name
                    os.truncate(path, path.stat().st_size - 1)
                else:
                    tier.storage.delete(f"{prefix}/{name}")
            put(self, tier, prefix, record)

        partdrain.PartDrains._put = losing  # type: ignore[method-assign]


def drain(rank: int, rec: dict[str, Any]) -> None:
    """``saves``, then a collective close. TIERSAVE_TEST_NODE1_BLOCK_STEP: node 1 cannot commit that step."""
    blocked = os.environ.get("TIERSAVE_TEST_NODE1_BLOCK_STEP")
    if blocked and os.environ.get("GROUP_RANK") == "1":  # a directory in the way of the commit's rename
        (Path(os.environ["TIERSAVE_SHM_DIR"]) / "run" / f"step-{int(blocked):010d}").mkdir(parents=True)
    inject_faults()
    with checkpointer() as ckpt:
        saves(ckpt, rank, rec)


def abandon(rank: int, rec: dict[str, Any]) -> None:
    """Two saves; node 1 dies during its part of step 2's drain (TIERSAVE_TEST_NODE1_CRASH), so rank 0's drain
    waits for a record that never comes (for the long coordination timeout), until rank 0 closes its
    Checkpointer with a short timeout: record how long close() took and how long until the drain ended."""
    ckpt = checkpointer()
    handles = [ckpt.save_async(step, state(rank, step)) for step in (1, 2)]
    for handle in handles:
        handle.result(60)
    future = handles[1].tiers["durable"]
    if rank != 0:
        future.exception(60)  # node 1 dies here, during its part
        return
    time.sleep(3)  # rank 0's own part is long written: its drain waits for node 1's record
    rec["waiting"] = not future.done()
    started = time.monotonic()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        ckpt.close(timeout=1)
    rec["close_s"] = time.monotonic() - started
    try:
        exc = future.exception(60)  # far below the coordination timeout: only close() ends the wait in time
        rec["error"] = f"{type(exc).__name__}: {exc}"
    except TimeoutError:
        rec["error"] = "still waiting"
    rec["ended_after_s"] = time.monotonic() - started
    rec["exit_now"] = True


def kill(rank: int, rec: dict[str, Any]) -> None:
    """``saves``, while node 1 dies (TIERSAVE_TEST_NODE1_CRASH: a crash point of its process) during its part of
    the last drain; rank 0 then leaves at once (no collective close: node 1 is gone)."""
    ckpt = checkpointer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saves(ckpt, rank, rec)
    rec["warnings"] = [str(w.message) for w in caught]
    rec["exit_now"] = True


def burst(rank: int, rec: dict[str, Any]) -> None:
    """Save STEPS steps back to back, every one due on the later tier, waiting for the drains only at the end:
    a tier still draining skips a step. Record which steps each node leader drained, and rank 0's warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with checkpointer() as ckpt:
            handles = [ckpt.save_async(step, state(rank, step)) for step in range(1, STEPS + 1)]
            ckpt.wait(120)
    sent = [h for h in handles if "durable" in h.tiers]
    rec["drained"] = [h.step for h in sent if h.tiers["durable"].exception(60) is None]
    rec["failed"] = [h.step for h in sent if h.tiers["durable"].exception(60) is not None]
    rec["warnings"] = [str(w.message) for w in caught]


def refused(rank: int, rec: dict[str, Any]) -> None:
    """A compressed later tier after a memory tier on nodes: refused on every rank when the Checkpointer opens."""
    tiers = [tiersave.Tier("mem://run"), tiersave.Tier(LATER, name="durable", compress="zstd")]
    try:
        tiersave.Checkpointer(tiers=tiers, coordination_timeout_s=TIMEOUT_S).close()
        rec["opened"] = True
    except tiersave.TiersaveError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"


def restore(rank: int, rec: dict[str, Any]) -> None:
    """Restore the newest checkpoint with the same chain (the memory of both nodes wiped: the later tier)."""
    live = state(rank, 0)
    with checkpointer() as ckpt:
        ckpt.restore(into=live)
        report = ckpt.last_restore
        rec.update(step=report.step, tier=report.tier, source=report.source)
    rec["consistent"] = same(live, state(rank, rec["step"]))


SCENARIOS = {f.__name__: f for f in (drain, kill, abandon, burst, refused, restore)}


def main() -> None:
    run_rank(lambda rank, world, rec: SCENARIOS[sys.argv[1]](rank, rec))


if __name__ == "__main__":
    main()
