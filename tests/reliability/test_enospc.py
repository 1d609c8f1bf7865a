"""Real ENOSPC on a small tmpfs (mounted for the test; skipped, with the reason, where mount is not permitted):
out of bytes (size=8m) and out of inodes (nr_inodes). Saves fill the disk until one fails: it must fail
with ``NoSpaceError``, sync and async; the previous checkpoints restore bit-exact; retrying the failing save
keeps failing the same way without the disk's usage growing (no leftover piles up); after ``prune`` makes
room, the save goes through.
"""

from __future__ import annotations

import os
import subprocess
import warnings

import pytest
import torch

import tiersave
from helpers import assert_same


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(640 * 1024, generator=g), "step": step}  # 2.5 MiB


@pytest.fixture(params=["size=8m", "size=64m,nr_inodes=16"], ids=["bytes", "inodes"])
def small_fs(request, tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"{request.param},mode=0755", "tmpfs", str(mnt)],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt, request.param
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def usage(path) -> tuple[int, int]:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_fails_typed_and_keeps_the_previous_checkpoints(small_fs, mode):
    small_fs, option = small_fs
    root = small_fs / "ckpt"
    root.mkdir()

    def save(ckpt, step):
        if mode == "async":
            return ckpt.save_async(step, state_for(step)).result()
        return ckpt.save(step, state_for(step))

    # keep_last: a tmpfs counts as a memory tier, whose default retention (2) would never let it fill
    with tiersave.Checkpointer(root, keep_last=1000, event_log=False, io_threads=2) as ckpt:
        saved, failure = [], None
        for step in range(1, 40):
            try:
                save(ckpt, step)
            except tiersave.NoSpaceError as exc:
                failure = exc
                break
            saved.append(step)
        assert failure is not None, f"the disk never filled: {saved}"
        assert saved, f"not even one save fitted: {failure}"
        assert str(step) in str(failure) or "space" in str(failure).lower(), failure
        first_usage = usage(small_fs)
        for _ in range(5):
            with pytest.raises(tiersave.NoSpaceError):
                save(ckpt, step)
            ckpt.wait(timeout=60, raise_errors=False)
            assert ckpt.catalog.steps() == saved
            bytes_used, inodes_used = usage(small_fs)
            assert bytes_used <= first_usage[0] and inodes_used <= first_usage[1], (
                f"a failed save's leftovers pile up: {usage(small_fs)} after, {first_usage} at the first failure"
            )
        assert not [p.name for p in root.iterdir() if ".tmp-" in p.name]
        with warnings.catch_warnings():  # a full root reads without a read lease, saying so (once per root)
            warnings.filterwarnings("ignore", "cannot write read leases", tiersave.TiersaveWarning)
            for held in saved:
                assert_same(ckpt.restore(held), state_for(held))
        ckpt.prune(keep_last=1)
        save(ckpt, step)
        assert_same(ckpt.restore(), state_for(step))
    print(
        f"ENOSPC ({option}, {mode}): retries=5 saves that fitted={len(saved)} failed typed={type(failure).__name__} violations=0"
    )
