"""kill -9 at random instants of retention over incremental checkpoints: every checkpoint still listed
afterwards restores bit for bit (docs/format.md section 9: a step is deleted only when no checkpoint that stays
references it, newest first, one atomic un-commit at a time)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import tiersave

PRUNE = """
import sys
from tiersave.catalog import Catalog
from tiersave.storage import open_storage
catalog = Catalog(open_storage(sys.argv[1]))
print("ready", flush=True)
catalog.prune(int(sys.argv[2]))
print("done", flush=True)
"""


BIG = (8 << 20) // 4 + 1024  # float32 elements just over 8 MiB: a shard of its own, referenced on its own


def build(root: Path, rng: random.Random) -> dict[int, dict[str, torch.Tensor]]:
    """Two large tensors changed one at a time (sometimes neither): a shard unchanged for one save and then
    changed makes references chain through steps (3 -> 2 -> 1), which retention must keep whole."""
    state = {"x": torch.randn(BIG), "y": torch.randn(BIG), "adapter": torch.zeros(1000)}
    saved = {}
    with tiersave.Checkpointer(root, incremental=True, full_every=rng.randint(3, 6), chunk_bytes=1 << 20) as ckpt:
        for step in range(1, 13):
            state["adapter"] += 1
            changed = rng.choice(["x", "y", None])
            if changed is not None:
                state[changed][rng.randrange(BIG)] += 1
            ckpt.save(step, state)
            saved[step] = {k: v.clone() for k, v in state.items()}
    return saved


def chains(root: Path) -> bool:
    """Whether a checkpoint references a step that references another (what a one-level mark got wrong)."""
    with tiersave.Checkpointer(root) as ckpt:
        refs = {i.step: ckpt.catalog.manifest(i.step).referenced_steps for i in ckpt.list()}
    return any(refs.get(r) for held in refs.values() for r in held)


def test_kill_during_retention_leaves_every_kept_checkpoint_restorable(tmp_path, seed):
    rng = random.Random(seed)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    killed_midway = chained = 0
    for attempt in range(6):
        root = tmp_path / f"root{attempt}"
        saved = build(root, rng)
        chained += chains(root)
        proc = subprocess.Popen(
            [sys.executable, "-c", PRUNE, str(root), str(rng.randint(1, 3))],
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == b"ready"
            time.sleep(rng.uniform(0, 0.02))
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
            killed_midway += b"done" not in out
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        with tiersave.Checkpointer(root) as ckpt:
            kept = [info.step for info in ckpt.list()]
            assert 12 in kept
            for step in kept:
                restored = ckpt.restore(step)
                for name, tensor in saved[step].items():
                    assert torch.equal(restored[name], tensor), (attempt, step, name)
            ckpt.prune(1)  # a later retention finishes the job, still without breaking anything
            for step in (info.step for info in ckpt.list()):
                assert ckpt.verify(step).ok
        shutil.rmtree(root)  # about 100 MiB each
    assert killed_midway >= 1  # at least one kill landed before retention finished
    assert chained >= 1  # and the roots held chains of references, the case a one-level mark broke
