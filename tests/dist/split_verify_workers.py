"""Rank programs for tests/dist/test_split_verify.py: a collective restore of replicated state whose checksums
the ranks of one machine split among themselves, in real processes (gloo on 127.0.0.1). Each rank writes what
it saw to ``$TIERSAVE_DIST_OUT/rank<R>.json``. Not a test module."""

from __future__ import annotations

import os
import signal
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
CHUNK = 64 << 10  # small checksum chunks: a 256 KiB tensor has four, so a message can name one of them


def ddp_state(rank: int, step: int) -> dict[str, Any]:
    """A model identical on every rank (large tensors of several chunks, medium ones of one chunk, small ones
    read in groups) and the rank's own tensor."""
    g = torch.Generator().manual_seed(step)
    model = {f"big{i}": torch.randn(1 << 16, generator=g) for i in range(4)}  # 256 KiB: four chunks each
    model.update({f"mid{i}": torch.randn(1 << 14, generator=g) for i in range(4)})  # 64 KiB: one chunk
    model.update({f"bias{i}": torch.randn(100, generator=g) for i in range(6)})  # read in groups
    return {"model": model, "own": torch.full((4096,), float(rank * 1000 + step))}


def zeros(rank: int) -> dict[str, Any]:
    live = ddp_state(rank, 1)
    for t in [*live["model"].values(), live["own"]]:
        t.zero_()
    return live


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["model"].keys() == b["model"].keys()
        and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and torch.equal(a["own"], b["own"])
    )


def checkpointer(root: Path = ROOT) -> tiersave.Checkpointer:
    return tiersave.Checkpointer(root, coordination_timeout_s=TIMEOUT_S, chunk_bytes=CHUNK, handle_sigterm=False)


def save(rank: int, world: int, rec: dict[str, Any]) -> None:
    with checkpointer() as ckpt:
        ckpt.save(1, ddp_state(rank, 1), replicated=["model"])
        rec["saved"] = True


def restore(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Restore step 1 into a zeroed live state (in place) and into new tensors; report what was left to the
    other ranks of the machine and whether the result is bit-exact, or the error."""
    root = Path(os.environ.get(f"TIERSAVE_TEST_ROOT_{rank}", str(ROOT)))  # a rank may read a copy of the root
    if os.environ.get("TIERSAVE_TEST_DIE_IN_AGREEMENT") == str(rank):
        import tiersave.restore as restore_module

        def die(*args: Any, **kwargs: Any) -> Any:  # this rank dies where the others wait for its report
            os.kill(os.getpid(), signal.SIGKILL)

        restore_module.agree_on_copy = die  # type: ignore[assignment]
    with checkpointer(root) as ckpt:
        start = time.monotonic()
        try:
            live = zeros(rank)
            ckpt.restore(1, into=live)
            rec["exact"] = equal(live, ddp_state(rank, 1))
            report = ckpt.last_restore
            rec["unchecked_bytes"] = report.unchecked_bytes
            rec["bytes_read"] = report.bytes_read
            fresh = ckpt.restore(1)
            rec["exact_new"] = equal(fresh, ddp_state(rank, 1))
            rec["unchecked_bytes_new"] = ckpt.last_restore.unchecked_bytes
        except tiersave.TiersaveError as exc:
            rec["error"] = error_record(exc, start)


class Model(torch.nn.Module):
    """The replicated state as a module's buffers (``load_state_dict`` judges their shapes at load time)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


def restore_mismatch(rank: int, world: int, rec: dict[str, Any]) -> None:
    """Restore step 1 into a live state whose ``model`` is a module; on ``$TIERSAVE_TEST_MISMATCH_RANK`` one of
    its buffers has another shape, which the module's ``load_state_dict`` refuses when the state is loaded."""
    live = zeros(rank)
    if str(rank) == os.environ.get("TIERSAVE_TEST_MISMATCH_RANK"):
        live["model"]["mid1"] = torch.zeros(3, 5)
    live["model"] = Model(live["model"])
    with checkpointer() as ckpt:
        start = time.monotonic()
        try:
            ckpt.restore(1, into=live)
            rec["restored"] = True
            ckpt.save(2, ddp_state(rank, 2), replicated=["model"])  # the group is still usable afterwards
            rec["saved_after"] = True
        except tiersave.TiersaveError as exc:
            rec["error"] = error_record(exc, start)
            try:
                ckpt.save(2, ddp_state(rank, 2), replicated=["model"])
                rec["saved_after"] = True
            except tiersave.TiersaveError as again:
                rec["save_after_error"] = error_record(again, start)


SCENARIOS = {f.__name__: f for f in (save, restore, restore_mismatch)}


if __name__ == "__main__":
    ckpt_workers.SCENARIOS.update(SCENARIOS)
    ckpt_workers.main()
