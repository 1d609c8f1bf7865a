"""A blocking save returns once its first tier's retention has renamed the old checkpoint away; the old
files are removed on the reclaimer's thread, which ``wait()`` and ``close()`` wait for (reclaim.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import tiersave
from tiersave.errors import CheckpointNotFoundError
from tiersave.storage.posix import LocalStorage


class GatedRemovals(LocalStorage):
    """A real local storage whose removal of trash directories waits for a gate (fault injection)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.removers: list[str] = []  # the threads that removed trash directories
        self.removed: set[str] = set()

    def delete_prefix(self, prefix: str) -> None:
        if ".trash-" in prefix:
            self.removers.append(threading.current_thread().name)
            self.removed.add(prefix.split(".trash-")[0])
            assert self.gate.wait(60), "the test never opened the gate"
        super().delete_prefix(prefix)


def _trash(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".trash-" in p.name)


def test_a_blocking_save_returns_before_the_old_checkpoints_files_are_removed(tmp_path: Path) -> None:
    storage = GatedRemovals(tmp_path)
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with tiersave.Checkpointer(storage, keep_last=1, event_log=False, handle_sigterm=False) as ckpt:
        ckpt.save(1, state)
        ckpt.save(2, state)  # would hang here (until the gate's 60 s) if save() waited for the removal
        assert ckpt.catalog.steps() == [2]  # retention is applied: step 1 is un-committed already
        with pytest.raises(CheckpointNotFoundError):
            ckpt.restore(step=1)
        assert len(_trash(tmp_path)) == 1  # its files wait for the reclaimer
        assert not ckpt.wait(timeout=0.2)  # wait() covers the removal
        storage.gate.set()
        assert ckpt.wait(timeout=60)
        assert _trash(tmp_path) == []
        assert all(name.startswith("tiersave-reclaim") for name in storage.removers)
        out = ckpt.restore()
        assert torch.equal(out["w"], state["w"])


def test_close_waits_for_the_removals(tmp_path: Path) -> None:
    storage = GatedRemovals(tmp_path)
    storage.gate.set()
    state = {"w": torch.ones(1 << 16)}
    ckpt = tiersave.Checkpointer(storage, keep_last=2, event_log=False, handle_sigterm=False)
    for step in range(1, 6):
        ckpt.save(step, state)
    ckpt.close()
    assert _trash(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-0000000004",
        "step-0000000005",
    ]
    assert storage.removed == {"step-0000000001", "step-0000000002", "step-0000000003"}
    # (a leftovers pass that listed a trash directory just before its removal ended may hand it over again)
    assert all(name.startswith("tiersave-reclaim") for name in storage.removers)


def test_an_explicit_prune_removes_the_files_before_it_returns(tmp_path: Path) -> None:
    storage = GatedRemovals(tmp_path)
    storage.gate.set()
    state = {"w": torch.ones(1024)}
    with tiersave.Checkpointer(storage, keep_last=None, event_log=False, handle_sigterm=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state)
        assert ckpt.prune(keep_last=1) == [1, 2]
        assert _trash(tmp_path) == []  # prune() promises the space back, not later
        assert all(not name.startswith("tiersave-reclaim") for name in storage.removers)


def test_a_removal_handed_over_after_close_happens_at_once(tmp_path: Path) -> None:
    # close() with a timeout may return while a save is still in flight; its retention then runs after
    from tiersave.reclaim import Reclaimer

    storage = LocalStorage(tmp_path)
    (tmp_path / "step-0000000001.trash-abc").mkdir()
    (tmp_path / "step-0000000001.trash-abc" / "shard.bin").write_bytes(b"x" * 4096)
    reclaimer = Reclaimer()
    reclaimer.close()
    reclaimer.later(storage, "step-0000000001.trash-abc")
    assert _trash(tmp_path) == []
