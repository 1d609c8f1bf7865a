"""Nth-operation I/O errors on every tier (SQLite's ioerr.test style): an error injected at each storage
operation of a save, one at a time, on local disk, ``mem://`` and S3 (the real SeaweedFS server), sync and
async, and at each operation of a drain to the second tier of a ``[mem, local]`` chain. After each one:
the error surfaced typed (a ``TiersaveError``), nothing of the failed save is visible, and the previous
checkpoint restores bit-exact.

Then the fsyncgate rule at the system-call level: the k-th ``fsync`` of a save fails once (a retry would
succeed, which is how Linux can report lost data as written); the save must fail, never call ``fsync`` on
that file again, and the step must stay invisible until a new save writes it again.

Each test prints one line: operations swept, errors surfaced typed, violations (asserted 0).
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch

import tiersave
from helpers import S3_TEST_OPTIONS, assert_same
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import Fault, FaultyStorage


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 1024, generator=g), "b": torch.randn(7, generator=g), "step": step, "name": "x"}


@pytest.fixture
def make_storage(tmp_path):
    """Returns a function making the real storage of a tier kind; removes what it made afterwards."""
    made: list = []

    def make(kind: str):
        if kind == "local":
            path = tmp_path / f"local-{len(made)}"
            path.mkdir()
            storage = LocalStorage(path)
        elif kind == "mem":
            from tiersave.storage.memory import MemoryStorage

            storage = MemoryStorage(f"ioerr-{uuid.uuid4().hex[:10]}")
        else:
            from tiersave.testing.seaweed import SeaweedServer

            storage = SeaweedServer.shared().storage(f"ts-{uuid.uuid4().hex[:20]}", "ioerr", **S3_TEST_OPTIONS)
        made.append((kind, storage))
        return storage

    yield make
    for kind, storage in made:
        if kind == "mem":
            shutil.rmtree(storage.root, ignore_errors=True)
        storage.close()


def committed(storage) -> list[int]:
    """Steps committed on ``storage``, seen by a fresh Checkpointer (no cached listing)."""
    with tiersave.Checkpointer(storage, event_log=False) as fresh:
        return fresh.catalog.steps()


def save(ckpt: tiersave.Checkpointer, step: int, mode: str) -> None:
    if mode == "async":
        ckpt.save_async(step, state_for(step)).result()
    else:
        ckpt.save(step, state_for(step))


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", ["local", "mem", "s3"])
def test_an_error_at_each_operation_of_a_save(make_storage, kind, mode):
    inner = make_storage(kind)
    storage = FaultyStorage(inner)
    typed = past_commit = 0
    violations: list[str] = []
    with tiersave.Checkpointer(storage, io_threads=2, keep_last=2, event_log=False) as ckpt:
        ckpt.save(1, state_for(1))
        before = storage.total
        save(ckpt, 2, mode)
        ckpt.wait(timeout=60)
        ops = storage.total - before  # the operations of one save, retention included
        ckpt.catalog.delete(2)
        for n in range(1, ops + 1):
            storage.faults = [Fault("*", storage.total + n)]
            try:
                save(ckpt, 2, mode)
            except tiersave.TiersaveError:
                typed += 1
                if committed(inner) != [1]:
                    violations.append(f"op {n}: a failed save left {committed(inner)} visible")
            except Exception as exc:
                violations.append(f"op {n}: untyped {type(exc).__name__}: {exc}")
            else:
                past_commit += 1  # the fault hit a follow-up (listing, retention) after the commit: it must hold
            ckpt.wait(timeout=60, raise_errors=False)  # the follow-up of an asynchronous save, too
            storage.faults = []
            if 2 in committed(inner):
                assert_same(ckpt.restore(2), state_for(2))
                ckpt.catalog.delete(2)
            assert_same(ckpt.restore(1), state_for(1))
        save(ckpt, 2, mode)  # nothing left in the way of a clean save of the same step
        assert_same(ckpt.restore(), state_for(2))
    print(
        f"I/O errors {kind} {mode}: operations={ops} typed_errors={typed} past_commit={past_commit} violations={len(violations)}"
    )
    assert not violations, "\n".join(violations)
    assert typed > 0


def test_an_error_at_each_operation_of_a_drain(make_storage):
    first, second = make_storage("mem"), make_storage("local")
    faulty = FaultyStorage(second)
    typed = after_commit = 0
    violations: list[str] = []
    tiers = [tiersave.Tier(first, name="mem", keep=3), tiersave.Tier(faulty, name="local", keep=3)]
    with tiersave.Checkpointer(tiers=tiers, io_threads=2, event_log=False) as ckpt:
        ckpt.save(1, state_for(1)).tier_result("local", timeout=60)
        ckpt.wait(timeout=60)
        before = faulty.total
        ckpt.save(2, state_for(2)).tier_result("local", timeout=60)
        ckpt.wait(timeout=60)
        ops = faulty.total - before
        step = 3
        for n in range(1, ops + 1):
            faulty.faults = [Fault("*", faulty.total + n)]
            handle = ckpt.save(step, state_for(step))
            assert "local" in handle.tiers, "an idle second tier must be sent every save"
            try:
                handle.tier_result("local", timeout=60)
            except tiersave.TiersaveError:
                typed += 1
            except Exception as exc:
                violations.append(f"op {n}: untyped {type(exc).__name__}: {exc}")
            ckpt.wait(timeout=60, raise_errors=False)
            faulty.faults = []
            steps = committed(second)
            if not steps or steps[-1] < 2:
                violations.append(f"op {n}: the second tier lost its earlier checkpoints: {steps}")
            if step in steps and handle.tiers["local"].exception() is not None:
                after_commit += 1  # failed after the copy was committed (reading it back): it must be whole
            with tiersave.Checkpointer(second, event_log=False) as alone:
                for held in steps:
                    assert_same(alone.restore(held), state_for(held))
            assert_same(ckpt.restore(step), state_for(step))  # the first tier holds it regardless
            step += 1
    print(
        f"I/O errors drain mem->local: operations={ops} typed_errors={typed} "
        f"failed_after_commit={after_commit} violations={len(violations)}"
    )
    assert not violations, "\n".join(violations)
    assert typed > 0


class FsyncFailsOnce:
    """``os.fsync`` that fails the k-th call under ``root`` with EIO once, and records later calls on that file."""

    def __init__(self, root: Path, k: int) -> None:
        self.root, self.k, self.calls, self.failed_inode, self.retried = str(root), k, 0, None, 0
        self.real = os.fsync

    def __call__(self, fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else ""
        if target.startswith(self.root):
            inode = os.fstat(fd).st_ino
            if inode == self.failed_inode and os.path.isfile(target):
                self.retried += 1
            self.calls += 1
            if self.calls == self.k:
                self.failed_inode = inode
                raise OSError(errno.EIO, "injected fsync error")
        self.real(fd)


def test_an_fsync_error_is_never_retried_into_a_success(root, monkeypatch):
    with tiersave.Checkpointer(root, keep_last=2, event_log=False) as ckpt:
        ckpt.save(1, state_for(1))
        counter = FsyncFailsOnce(root, 0)
        monkeypatch.setattr(os, "fsync", counter)
        ckpt.save(2, state_for(2))
        fsyncs = counter.calls
        ckpt.catalog.delete(2)
        violations = []
        for k in range(1, fsyncs + 1):
            failing = FsyncFailsOnce(root, k)
            monkeypatch.setattr(os, "fsync", failing)
            try:
                ckpt.save(2, state_for(2))
                violations.append(f"fsync {k} of {fsyncs} failed and the save still reported success")
                ckpt.catalog.delete(2)
            except tiersave.StorageError as exc:
                if "injected fsync error" not in str(exc):
                    violations.append(f"fsync {k}: the error does not say what failed: {exc}")
            if failing.retried:
                violations.append(f"fsync {k}: the failed file was fsynced again {failing.retried} time(s)")
            monkeypatch.setattr(os, "fsync", failing.real)
            if committed(root) != [1]:
                violations.append(f"fsync {k}: the save failed, yet it left {committed(root)} visible")
                ckpt.catalog.delete(2)
            assert_same(ckpt.restore(), state_for(1))
        ckpt.save(2, state_for(2))  # written again from the source, not from the failed file
        assert_same(ckpt.restore(), state_for(2))
    print(f"fsync errors local: fsyncs_per_save={fsyncs} violations={len(violations)}")
    assert fsyncs >= 3, "the save made too few fsyncs for the sweep to mean anything"
    assert not violations, "\n".join(violations)
