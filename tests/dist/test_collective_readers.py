"""Concurrent readers during multi-rank saves and retention (real multi-process jobs, gloo on 127.0.0.1): a
reader process restores and verifies while the ranks save step after step and delete the previous step."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from helpers import worker_env
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.storage.posix import LocalStorage

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "replicated_workers.py"
TIMEOUT = 8.0


def test_readers_during_multi_rank_saves_and_retention_never_see_a_torn_or_corrupt_checkpoint(launch, tmp_path):
    """A reader restores and verifies the newest checkpoint in a loop while 3 ranks save step after step with
    keep_last=1 (each save deletes the one before): every restore returns one step's state whole, and every
    verify of a checkpoint that still exists passes. A checkpoint deleted under the reader is not damage."""
    sys.path.insert(0, str(HERE))
    from replicated_workers import loop_state

    root = tmp_path / "ckpt"
    job = launch(
        "save_loop_keep1",
        3,
        env=worker_env(root, TIMEOUT),
        script=SCRIPT,
        background=True,
    )
    restores = verifies = torn = corrupt = vanished = 0
    try:
        deadline = time.monotonic() + 60
        while not (root.exists() and Catalog(LocalStorage(root)).steps()):
            assert time.monotonic() < deadline, "the job committed nothing in 60 s"
            time.sleep(0.2)
        catalog = Catalog(LocalStorage(root))
        reader = tiersave.Checkpointer(root, event_log=False, handle_sigterm=False)
        end = time.monotonic() + 12
        rank = 0
        while time.monotonic() < end:
            rank = (rank + 1) % 3
            state = reader.restore(rank=rank)
            step = reader.last_restore.step
            expected = loop_state(rank, step)
            whole = torch.equal(state["w"], expected["w"]) and all(
                torch.equal(state["model"][k], v) for k, v in expected["model"].items()
            )
            torn += not whole
            restores += 1
            steps = catalog.steps()
            if not steps:
                continue
            try:
                report = catalog.verify(steps[-1])
                ok = report.ok
            except (tiersave.CorruptCheckpointError, tiersave.CheckpointNotFoundError, tiersave.StorageError):
                ok = False
            if not ok:
                if steps[-1] in Catalog(LocalStorage(root)).steps():
                    corrupt += 1
                else:
                    vanished += 1
            verifies += 1
        reader.close()
    finally:
        for r in range(3):
            job.kill(r)
        job.finish(15)
    acked = max(int(x) for x in (job.out / "acked0.txt").read_text().split())
    print(f"{restores} restores, {verifies} verifies, {vanished} deleted under the reader, {acked} saves")
    assert restores >= 5 and verifies >= 5 and acked >= 5
    assert torn == 0 and corrupt == 0
