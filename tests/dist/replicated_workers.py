"""Rank programs for tests/dist/test_collective_replicated.py: a collective ``tiersave.Checkpointer`` saving a
DDP-like state (a model and its optimizer identical on every rank, declared ``replicated``) next to per-rank
state, in real processes (gloo on 127.0.0.1). Each rank writes what it saw to
``$TIERSAVE_DIST_OUT/rank<R>.json``. Not a test module."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import tiersave

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckpt_workers
from ckpt_workers import error_record

TIMEOUT_S = float(os.environ.get("TIERSAVE_DIST_TIMEOUT", "10"))
ROOT = Path(os.environ.get("TIERSAVE_TEST_ROOT", "/nonexistent"))
SECOND = os.environ.get("TIERSAVE_TEST_SECOND")


def ddp_state(rank: int, step: int) -> dict[str, Any]:
    """What a DDP rank holds: a model and Adam state identical on every rank (same seed, same step), and its
    own data position and per-rank tensor."""
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 256), torch.nn.Linear(256, 40))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(step):
        loss = model(torch.arange(16) % 300).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
    return {
        "model": model,
        "optim": optim,
        "w": torch.full((1024,), float(rank * 1000 + step)),
        "data": {"rank": rank, "position": step * 10 + rank},
    }


def flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for i, s in state["optim"].state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in s.items() if isinstance(v, torch.Tensor)})
    out["w"] = state["w"]
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ta, tb = flat_tensors(a), flat_tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta) and a["data"] == b["data"]


def replicated_save_restore(rank: int, world: int, rec: dict[str, Any]) -> None:
    tiers: list[Any] = [str(ROOT)] + ([tiersave.Tier(SECOND, name="second")] if SECOND else [])
    with tiersave.Checkpointer(tiers=tiers, coordination_timeout_s=TIMEOUT_S) as ckpt:
        h1 = ckpt.save(1, ddp_state(rank, 1), replicated=["model", "optim"])
        h2 = ckpt.save_async(2, ddp_state(rank, 2), replicated=["model", "optim"])
        h2.result(60)
        rec["written_bytes"] = [h1.stats.tensor_bytes, h2.stats.tensor_bytes]
        ckpt.wait(60)
        live = ddp_state(rank, 0)
        ckpt.restore(into=live)
        rec["restored_latest"] = same(live, ddp_state(rank, 2))
        live = ddp_state(rank, 0)
        ckpt.restore(1, into=live)
        rec["restored_1"] = same(live, ddp_state(rank, 1))
        rec["bytes_read"] = ckpt.last_restore.bytes_read


def replicated_mismatch(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Rank 1's model differs from the others' (a missed all-reduce): every rank's save fails, naming it."""
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S) as ckpt:
        state = ddp_state(rank, 1)
        if rank == 1:
            with torch.no_grad():
                state["model"][1].weight[7, 3] += 1.0
        rec["save1"] = try_save(ckpt, state)
        rec["latest_after_failure"] = ckpt.latest().step if ckpt.latest() is not None else None
        ckpt.save(2, state, replicated=["optim"])  # the group is still usable; optim does agree
        rec["latest"] = ckpt.latest().step


def replicated_missing_key(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Rank 1 declares a key its state lacks: its own error there, a ConfigError naming it elsewhere."""
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S) as ckpt:
        state = ddp_state(rank, 1)
        if rank == 1:
            del state["optim"]
        rec["save1"] = try_save(ckpt, state)


def try_save(ckpt: tiersave.Checkpointer, state: dict[str, Any]) -> Any:
    """Save step 1 declaring the model and optimizer replicated: "ok", or the error's record."""
    start = time.monotonic()
    try:
        ckpt.save(1, state, replicated=["model", "optim"])
        return "ok"
    except tiersave.TiersaveError as exc:
        return error_record(exc, start)


def loop_state(rank: int, step: int) -> dict[str, Any]:
    """A state whose every tensor says which step (and rank) it belongs to, so a reader can tell a torn read:
    a model replicated on every rank (several tensors, so each rank writes a share) and per-rank tensors."""
    model = {f"layer{i}": torch.full((4096 * (i + 1),), float(step * 10 + i)) for i in range(6)}
    return {"model": model, "w": torch.full((8192,), float(rank * 1_000_000 + step)), "data": {"step": step}}


def save_loop_keep1(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Save step after step with keep_last=1 until killed (the reader test stops the job)."""
    path = Path(os.environ["TIERSAVE_DIST_OUT"]) / f"acked{rank}.txt"
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S, keep_last=1) as ckpt, open(path, "a") as acked:
        step = 1
        while True:
            ckpt.save(step, loop_state(rank, step), replicated=["model"])
            acked.write(f"{step}\n")
            acked.flush()
            step += 1


def restore_io_paths(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Save a replicated model of large tensors (and a per-rank tensor) on a direct-I/O root, restore it, and
    record the bytes the restore moved per I/O path ("direct", "buffered")."""
    from tiersave.storage.posix import LocalStorage

    def state(step: int) -> dict[str, Any]:
        model = {f"layer{i}": torch.full((1 << 18,), float(step * 10 + i)) for i in range(4)}  # 1 MiB each
        return {"model": model, "w": torch.full((1 << 18,), float(rank * 1000 + step))}

    storage = LocalStorage(ROOT, io="direct")
    with tiersave.Checkpointer(storage, coordination_timeout_s=TIMEOUT_S) as ckpt:
        ckpt.save(1, state(1), replicated=["model"])
        rec["direct_refused"] = bool(storage.io_policy.refused)
        before = storage.io_stats.bytes_by_path()
        live = state(0)
        ckpt.restore(1, into=live)
        after = storage.io_stats.bytes_by_path()
        rec["read"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
        rec["restored"] = all(torch.equal(live["model"][k], v) for k, v in state(1)["model"].items())
        rec["restored"] = rec["restored"] and torch.equal(live["w"], state(1)["w"])


def reuse_state(rank: int, step: int) -> dict[str, Any]:
    """A replicated model (a module and a dict of tensors, identical on every rank) and per-rank state, whose
    structure :func:`replicated_reuse` changes between saves."""
    torch.manual_seed(99)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    extra = {f"k{i}": torch.randn(64 * (i + 1)) for i in range(5)}
    return {"model": model, "extra": extra, "w": torch.full((512,), float(rank)), "data": {"position": step}}


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Copies of every tensor of ``state`` by flattened name, and its data position."""
    from tiersave.state import flatten

    out: dict[str, Any] = {t.name: torch.as_tensor(t.source).clone() for t in flatten(state).tensors}
    out["$position"] = state["data"]["position"]
    return out


def replicated_reuse(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Async replicated saves whose structure changes between some of them (a key added, a tensor reshaped, a
    per-rank tensor cast) and not between others (new values, a new data position): each save reuses the
    previous layout exactly when nothing changed, and every step restores bit-exact on every rank."""
    state = reuse_state(rank, 0)
    changes = [
        lambda s: None,  # the first save: nothing to reuse
        lambda s: None,  # same structure, new values
        lambda s: s["extra"].__setitem__("k5", torch.randn(32)),  # a replicated key added
        lambda s: s["extra"].__setitem__("k1", s["extra"]["k1"].reshape(8, 16)),  # a view of other shape
        lambda s: s.__setitem__("w", s["w"].double()),  # a per-rank dtype
        lambda s: s["extra"].pop("k0"),  # a replicated key removed
        lambda s: None,  # same structure again
    ]
    expected, reused = {}, []
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S, keep_last=20) as ckpt:
        for step, change in enumerate(changes, start=1):
            change(state)
            with torch.no_grad():  # new bytes in every tensor (the same on every rank for replicated ones)
                for p in state["model"].parameters():
                    p.add_(0.5)
                for t in state["extra"].values():
                    t.add_(0.25)
                state["w"].add_(1.0)
            state["data"]["position"] = step * 10 + rank
            handle = ckpt.save_async(step, state, replicated=["model", "extra"])
            expected[step] = snapshot(state)
            handle.result(60)
            reused.append(bool(handle.stats.extra.get("layout_reused")))
        rec["reused"] = reused
        rec["exact"] = []
        for step, want in expected.items():
            got = snapshot_restored(ckpt.restore(step))
            rec["exact"].append(got.keys() == want.keys() and all(_equal(got[k], want[k]) for k in want))


def snapshot_restored(tree: dict[str, Any]) -> dict[str, Any]:
    out = snapshot({**tree, "data": tree["data"]})
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def replicated_async_mismatch(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Rank 1's model differs from the others' and the first save declaring it replicated is a save_async:
    save_async returns without waiting for the other ranks, and the save fails through its handle on every
    rank, naming the key and the rank; nothing is committed; a later save whose declaration holds commits."""
    with tiersave.Checkpointer(ROOT, coordination_timeout_s=TIMEOUT_S) as ckpt:
        state = ddp_state(rank, 1)
        if rank == 1:
            with torch.no_grad():
                state["model"][1].weight[7, 3] += 1.0
            time.sleep(3.0)  # the other ranks' save_async must not wait for this rank
        start = time.monotonic()
        handle = ckpt.save_async(1, state, replicated=["model", "optim"])
        rec["blocked_s"] = time.monotonic() - start
        try:
            handle.result(60)
            rec["save1"] = "ok"
        except tiersave.TiersaveError as exc:
            rec["save1"] = error_record(exc, start)
        rec["latest_after_failure"] = ckpt.latest().step if ckpt.latest() is not None else None
        ckpt.save_async(2, state, replicated=["optim"]).result(60)  # optim does agree
        rec["latest"] = ckpt.latest().step


SCENARIOS = {
    f.__name__: f
    for f in (
        replicated_save_restore,
        replicated_mismatch,
        replicated_missing_key,
        save_loop_keep1,
        restore_io_paths,
        replicated_reuse,
        replicated_async_mismatch,
    )
}


if __name__ == "__main__":
    ckpt_workers.SCENARIOS.update(SCENARIOS)
    ckpt_workers.main()
