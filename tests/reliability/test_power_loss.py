"""Simulated power loss (tiersave.testing.powerloss): a cut at every fsync and every acknowledgement of a
run of saves; on every tree such a cut could leave, restore must give the last acknowledged checkpoint (or a
newer one), bit-exact, never a torn one, and before any acknowledgement either a valid checkpoint or a typed
error.

The checker is shown to be real: with the commit's directory fsync removed, or the shards' file fsync
removed (monkeypatched out of the library for one test), it must find violations.
"""

from __future__ import annotations

import os
import types
import warnings
from pathlib import Path

import pytest
import torch

import tiersave
from helpers import assert_same
from tiersave.testing.powerloss import Cut, PowerLossRecorder


def small_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": {f"l{i}": torch.randn(64, 64, generator=g) for i in range(4)},
        "b": torch.randn(5, generator=g),
        "step": step,
    }


def record_saves(root: Path, steps: range, *, mode: str, max_shard_bytes: int | None = None) -> PowerLossRecorder:
    with (
        PowerLossRecorder(root) as rec,
        tiersave.Checkpointer(root, keep_last=2, io_threads=2, max_shard_bytes=max_shard_bytes) as ckpt,
    ):
        for step in steps:
            if mode == "async":
                ckpt.save_async(step, small_state(step)).result()
            else:
                ckpt.save(step, small_state(step))
            rec.mark_acked(step)
    return rec


def violation(rec: PowerLossRecorder, cut: Cut, dest: Path, image: str) -> str | None:
    """None if the tree a cut at ``cut`` leaves holds the invariant, else what went wrong."""
    img = rec.materialize(cut, dest, image)  # type: ignore[arg-type]
    where = f"cut {cut.index} ({cut.label}, acked {list(cut.acked)}, {image} image)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tiersave.TiersaveWarning)  # a fallback warns; the step is what counts
        try:
            with tiersave.Checkpointer(img, event_log=False) as ckpt:
                restored = ckpt.restore()
                step = ckpt.last_restore.step
                if cut.acked and step < cut.acked[-1]:
                    return f"{where}: restored step {step}, acknowledged step {cut.acked[-1]} was lost"
                assert_same(restored, small_state(step))
                if cut.acked:
                    assert_same(ckpt.restore(cut.acked[-1]), small_state(cut.acked[-1]))
        except tiersave.TiersaveError as exc:
            if cut.acked:
                return f"{where}: {type(exc).__name__}: {exc}"
        except AssertionError as exc:
            return f"{where}: restored a state that differs from the one saved: {exc}"
    return None


def check_all(rec: PowerLossRecorder, tmp: Path) -> tuple[int, list[str]]:
    """Check every distinct crash image; returns (images checked, violations)."""
    seen: set[tuple] = set()
    found: list[str] = []
    for cut in rec.cuts:
        for image in ("strict", "metadata"):
            dirs = cut.durable_dirs if image == "strict" else cut.live_dirs
            files = tuple(
                (rel, len(cut.durable_files.get(ino, b""))) for rel, kind, ino in rec._walk(dirs, rec.root_ino, "")
            )
            key = (cut.acked, files)
            if key in seen:
                continue
            seen.add(key)
            problem = violation(rec, cut, tmp / f"img-{len(seen)}", image)
            if problem:
                found.append(problem)
    return len(seen), found


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_power_cut_at_every_fsync_keeps_the_last_acknowledged_checkpoint(tmp_path, mode):
    root = tmp_path / "ckpt"
    root.mkdir()
    rec = record_saves(root, range(1, 6), mode=mode)
    images, found = check_all(rec, tmp_path / "images")
    print(f"power loss ({mode}): cuts={len(rec.cuts)} fsyncs={rec.fsyncs} images={images} violations={len(found)}")
    assert rec.fsyncs >= 5 * 4, "the recorder saw too few fsyncs: it is not watching the saves"
    assert not found, "\n".join(found[:5])


@pytest.mark.long
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_power_cut_long_run_with_several_shards(tmp_path, mode):
    """The long variant: 20 saves of 4 shards each (more files, more fsyncs, retention at every save)."""
    root = tmp_path / "ckpt"
    root.mkdir()
    rec = record_saves(root, range(1, 21), mode=mode, max_shard_bytes=16 * 1024)
    images, found = check_all(rec, tmp_path / "images")
    print(f"power loss long ({mode}): cuts={len(rec.cuts)} fsyncs={rec.fsyncs} images={images} violations={len(found)}")
    assert rec.fsyncs >= 20 * 6
    assert not found, "\n".join(found[:5])


def test_power_cut_with_buffered_saves_that_start_their_writeback_early(tmp_path, monkeypatch):
    """Blocking saves on buffered storage (written from the tensors) with their writeback started every 4 KiB:
    ``sync_file_range`` promises no durability and the recorder counts none, so every cut must still keep the
    invariant on the strength of the unchanged fsyncs."""
    from tiersave.storage.posix import writeback

    real = writeback.sync_range
    assert real is not None
    started = []

    def counted(fd, offset, nbytes, flags):
        started.append(nbytes)
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(writeback, "sync_range", counted)
    monkeypatch.setenv("TIERSAVE_IO", "buffered")
    monkeypatch.setenv("TIERSAVE_WRITEBACK_BYTES", "4096")
    root = tmp_path / "ckpt"
    root.mkdir()
    rec = record_saves(root, range(1, 6), mode="sync")
    _images, found = check_all(rec, tmp_path / "images")
    assert len(started) >= 5, "the saves did not start their writeback early"  # a range per save at least
    assert rec.fsyncs >= 5 * 4
    assert not found, "\n".join(found[:5])


def _without_commit_dir_fsync(monkeypatch, root: Path) -> None:
    """The library with the fsync of the root after the commit's rename removed."""
    from tiersave.storage.posix import local

    real = local.fsync_dir
    root_ino = os.stat(root).st_ino

    def fsync_dir(target):
        ino = os.fstat(target).st_ino if isinstance(target, int) else os.stat(target).st_ino
        if ino != root_ino:
            real(target)

    monkeypatch.setattr(local, "fsync_dir", fsync_dir)


def _without_shard_fsync(monkeypatch, root: Path) -> None:
    """The library with the shards' fsync (BlobWriter.finish) removed."""
    from tiersave.storage.posix import blobs

    fake_os = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    fake_os.fsync = lambda fd: None
    monkeypatch.setattr(blobs, "os", fake_os)


@pytest.mark.parametrize(
    "broken", [_without_commit_dir_fsync, _without_shard_fsync], ids=["no-dir-fsync", "no-file-fsync"]
)
def test_the_power_loss_check_detects_a_missing_fsync(tmp_path, monkeypatch, broken):
    root = tmp_path / "ckpt"
    root.mkdir()
    broken(monkeypatch, root)
    rec = record_saves(root, range(1, 4), mode="sync")
    images, found = check_all(rec, tmp_path / "images")
    print(f"power loss with {broken.__name__}: images={images} violations={len(found)} (expected > 0)")
    assert found, (
        f"{broken.__name__}: the power-loss check found nothing; it cannot tell a durable commit from a lost one"
    )
    assert any("acknowledged step" in f or "differs" in f or "Error" in f for f in found)
