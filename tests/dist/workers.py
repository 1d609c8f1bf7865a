"""Rank programs for the tests in tests/dist, run as real processes (``python workers.py SCENARIO`` or under
torchrun). Each rank joins the job through torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE), plays SCENARIO and writes what it saw to ``$TIERSAVE_DIST_OUT/rank<R>.json``; the tests assert
on those files. Not a test module (no ``test_`` prefix): pytest never imports it."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tiersave.dist import CoordinationGroup
from tiersave.errors import DistributedCheckpointError, NoSpaceError

TIMEOUT_S = float(os.environ.get("TIERSAVE_DIST_TIMEOUT", "10"))
UNICODE = 'π ✓ 日本語 🚀 "quotes" \\ back\nslash \u0000 nul'


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run fn; what happened, as JSON: the value, or the error with its per-rank failures, and the time."""
    start = time.monotonic()
    try:
        value = fn()
    except DistributedCheckpointError as exc:
        return {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "failures": {str(r): [type(e).__name__, str(e)] for r, e in exc.failures.items()},
            "elapsed": time.monotonic() - start,
        }
    return {"ok": True, "value": value, "elapsed": time.monotonic() - start}


def basic(rank: int, world: int, rec: dict[str, Any]) -> None:
    group = CoordinationGroup(timeout_s=TIMEOUT_S)
    rec["identity"] = vars(group.identity)
    rec["nonce"] = group.nonce

    big = "x" * (300_000 + rank) + UNICODE
    mine = {"rank": rank, "text": UNICODE, "big": big, "nested": [1, 2.5, None, True, {"k": []}]}
    gathered = group.gather_json(mine, step=1)
    expected = [{**mine, "rank": r, "big": "x" * (300_000 + r) + UNICODE} for r in range(world)]
    rec["gather"] = gathered == expected if rank == 0 else gathered
    rec["broadcast"] = group.broadcast_json({"emoji": "🚀", "n": [1, 2.5]} if rank == 0 else {"ignored": rank})
    rec["all_gather_none"] = group.all_gather_json(None)
    rec["all_gather_empty"] = group.all_gather_json("" if rank % 2 else {})
    rec["all_gather_unicode"] = group.all_gather_json(f"{UNICODE}-{rank}")
    rec["new_nonce"] = group.new_nonce()

    rec["agree_same"] = attempt(lambda: group.agree(7, what="step", step=7))
    rec["agree_differs"] = attempt(
        lambda: group.agree("abc" if rank != world - 1 else "xyz", what="fingerprint of model.w", step=7)
    )

    calls: list[list[Any]] = []

    def commit(payloads: list[Any]) -> Any:
        calls.append(payloads)
        return {"manifest": f"step-{len(calls)}", "ranks": len(payloads)}

    def failing_commit(payloads: list[Any]) -> Any:
        calls.append(payloads)
        raise OSError("global manifest write failed")

    entries = {"files": [f"rank{rank}.bin"], "bytes": 1000 + rank}
    rec["vote_yes"] = attempt(lambda: vars(group.vote(10, entries, commit=commit)))
    rec["calls_after_yes"] = len(calls)
    rec["payloads_seen"] = calls[0] if calls else None

    def no_vote() -> Any:
        if rank == 1:
            return vars(group.vote(11, error=NoSpaceError("disk full on rank 1"), commit=commit))
        return vars(group.vote(11, entries, commit=commit))

    rec["vote_no"] = attempt(no_vote)
    rec["calls_after_no"] = len(calls)
    rec["vote_commit_raises"] = attempt(lambda: vars(group.vote(12, entries, commit=failing_commit)))
    rec["calls_after_commit_raises"] = len(calls)
    rec["vote_other_step"] = attempt(lambda: vars(group.vote(13 if rank != 2 else 14, entries, commit=commit)))
    rec["vote_not_json"] = attempt(lambda: vars(group.vote(15, {1, 2} if rank == 1 else entries, commit=commit)))
    rec["calls_before_thread"] = len(calls)

    box: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: box.update(r=attempt(lambda: vars(group.vote(16, entries, commit=commit)))), daemon=True
    )
    thread.start()
    thread.join(TIMEOUT_S * 3)
    rec["vote_thread"] = box.get("r", "thread did not finish")
    rec["vote_last"] = attempt(lambda: vars(group.vote(17, entries, commit=commit)))
    rec["calls_end"] = len(calls)
    rec["poisoned"] = group.poisoned

    # Last, because it poisons the group: the last rank makes a different call from the others.
    if rank == world - 1:
        rec["out_of_step"] = attempt(lambda: group.agree(18, what="step"))
    else:
        rec["out_of_step"] = attempt(lambda: vars(group.vote(18, entries, commit=commit)))
    rec["calls_out_of_step"] = len(calls)
    rec["poisoned_at_end"] = group.poisoned


def hang(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Rank $TIERSAVE_DIST_VICTIM sleeps past the others' deadline before voting."""
    victim = int(os.environ["TIERSAVE_DIST_VICTIM"])
    group = CoordinationGroup(timeout_s=TIMEOUT_S)
    if rank == victim:
        time.sleep(TIMEOUT_S * 2 + 1)
    rec["vote"] = attempt(lambda: vars(group.vote(3, {"rank": rank}, commit=lambda p: "committed")))
    rec["later"] = attempt(lambda: group.agree(3, what="step"))
    rec["poisoned"] = group.poisoned


def killed(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Rank $TIERSAVE_DIST_VICTIM is SIGKILLed before voting."""
    victim = int(os.environ["TIERSAVE_DIST_VICTIM"])
    group = CoordinationGroup(timeout_s=TIMEOUT_S)
    group.agree(1, what="step")  # everyone is up and connected before the kill
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    rec["vote"] = attempt(lambda: vars(group.vote(4, {"rank": rank}, commit=lambda p: "committed")))
    rec["poisoned"] = group.poisoned


def undelivered(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Rank 0's commit callback SIGKILLs the last rank while it waits for the outcome: the outcome cannot
    be delivered to it, which only rank 0 learns (the others got the outcome). Rank 0's next call fails at
    once and must tell the others which rank failed before it goes on (here: tears down and exits)."""
    group = CoordinationGroup(timeout_s=TIMEOUT_S)
    pids = group.all_gather_json(os.getpid())
    victim = world - 1

    def commit(payloads: list[Any]) -> Any:
        os.kill(pids[victim], signal.SIGKILL)
        time.sleep(0.5)  # gone, and gloo has read the closed connection before the outcome is sent
        return "committed"

    rec["first"] = attempt(lambda: vars(group.vote(1, {"rank": rank}, commit=commit)))
    rec["second"] = attempt(lambda: vars(group.vote(2, {"rank": rank}, commit=commit)))
    rec["poisoned"] = group.poisoned


def nodes(rank: int, world: int, rec: dict[str, Any]) -> None:
    group = CoordinationGroup(timeout_s=TIMEOUT_S)
    rec["env"] = {k: os.environ.get(k) for k in ("GROUP_RANK", "LOCAL_RANK", "RANK")}
    rec["identity"] = vars(group.identity)
    rec["identities"] = [vars(i) for i in group.identities]
    rec["vote"] = attempt(lambda: vars(group.vote(5, {"rank": rank}, commit=lambda p: len(p))))


def solo(rank: int, world: int, rec: dict[str, Any]) -> None:
    """A one-rank job: every call works without any message."""
    group = CoordinationGroup(timeout_s=TIMEOUT_S)
    rec["identity"] = vars(group.identity)
    rec["all_gather"] = group.all_gather_json({"k": UNICODE})
    rec["agree"] = attempt(lambda: group.agree(1, what="step"))
    rec["vote"] = attempt(lambda: vars(group.vote(1, {"f": 1}, commit=lambda p: {"payloads": p})))
    rec["vote_no"] = attempt(lambda: vars(group.vote(2, error=OSError("EIO"), commit=lambda p: "never")))


def chaos(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Votes back to back until rank $TIERSAVE_DIST_VICTIM is SIGKILLed at a random instant (seeded)."""
    import random

    rng = random.Random(int(os.environ["TIERSAVE_DIST_SEED"]) * 1000 + rank)
    victim = int(os.environ["TIERSAVE_DIST_VICTIM"])
    group = CoordinationGroup(timeout_s=TIMEOUT_S)
    if rank == victim:
        delay = rng.uniform(0.2, 1.5)
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    committed: list[int] = []
    commits: list[int] = []
    anomalies: list[str] = []

    def commit(payloads: list[Any]) -> Any:
        step = len(commits) + 1
        if [p.get("rank") if isinstance(p, dict) else None for p in payloads] != list(range(world)):
            anomalies.append(f"step {step}: payloads {payloads!r:.200}")
        commits.append(step)
        return step

    rec["error"] = None
    end = time.monotonic() + 30
    step = 0
    while time.monotonic() < end:
        step += 1
        payload = {"rank": rank, "pad": "p" * rng.randrange(0, 200_000)}
        outcome = attempt(lambda step=step, payload=payload: vars(group.vote(step, payload, commit=commit)))
        if not outcome["ok"]:
            rec["error"] = outcome
            break
        committed.append(outcome["value"]["result"])
        time.sleep(rng.uniform(0, 0.01))
    rec["committed"] = committed
    rec["commits"] = commits
    rec["anomalies"] = anomalies
    rec["later"] = attempt(lambda: group.agree(0, what="step"))


SCENARIOS = {
    "chaos": chaos,
    "solo": solo,
    "basic": basic,
    "hang": hang,
    "killed": killed,
    "nodes": nodes,
    "undelivered": undelivered,
}


def main() -> None:
    scenario = SCENARIOS[sys.argv[1]]
    out = Path(os.environ["TIERSAVE_DIST_OUT"])
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    rec: dict[str, Any] = {"rank": rank, "world": world}
    try:
        scenario(rank, world, rec)
        # Tearing down must not hang, even with a poisoned group holding receives that never completed.
        start = time.monotonic()
        dist.destroy_process_group()
        rec["teardown_s"] = time.monotonic() - start
    except BaseException as exc:
        rec["crashed"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        tmp = out / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(rec, ensure_ascii=False))
        tmp.rename(out / f"rank{rank}.json")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
