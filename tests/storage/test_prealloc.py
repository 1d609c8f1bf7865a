"""Preallocation is bounded by the size the writer knows: a save killed mid-write of a 4 MiB state leaves a
file of at most its shard's size, not 256 MiB.

Real direct I/O on the ext4 work disk (pytest's tmp_path); the killed save is a real process that SIGKILLs
itself at the crash point between the shard writes and ``finish`` (which would trim the excess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiersave.storage.posix import LocalStorage
from tiersave.storage.posix.directio import probe_direct_io


@pytest.fixture
def direct_root(tmp_path: Path) -> Path:
    if not probe_direct_io(tmp_path):
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    return tmp_path


def aligned_bytes(n: int) -> memoryview:
    import mmap

    buf = mmap.mmap(-1, n)  # page-aligned: the write goes direct, in place
    buf.write(b"\x5a" * n)
    return memoryview(buf)


def allocated(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_blocks * 512


def test_size_hint_bounds_preallocation_mid_write(direct_root: Path) -> None:
    storage = LocalStorage(direct_root, io="direct")
    size = 4 << 20
    writer = storage.open_writer("shard.bin", size_hint=size)
    writer.write_at(0, aligned_bytes(1 << 20))
    file_size, blocks = allocated(direct_root / "shard.bin")
    assert file_size <= size and blocks <= size, (file_size, blocks)  # was 256 MiB
    writer.write_at(1 << 20, aligned_bytes(3 << 20))
    writer.finish(size)
    assert allocated(direct_root / "shard.bin")[0] == size


def test_without_a_hint_preallocation_stays_within_twice_what_was_written(direct_root: Path) -> None:
    storage = LocalStorage(direct_root, io="direct")
    writer = storage.open_writer("shard.bin")
    written = 0
    for _ in range(4):
        writer.write_at(written, aligned_bytes(1 << 20))
        written += 1 << 20
        file_size, blocks = allocated(direct_root / "shard.bin")
        assert file_size <= 2 * written and blocks <= 2 * written, (written, file_size, blocks)
    writer.abort()
    assert not (direct_root / "shard.bin").exists()


def test_writing_past_the_hint_still_works(direct_root: Path) -> None:
    storage = LocalStorage(direct_root, io="direct")
    writer = storage.open_writer("shard.bin", size_hint=4096)
    writer.write_at(0, aligned_bytes(1 << 20))
    writer.finish(1 << 20)
    assert storage.get("shard.bin") == b"\x5a" * (1 << 20)


def test_a_save_killed_mid_write_leaves_at_most_its_shard_size(direct_root: Path) -> None:
    root = direct_root / "ckpt"
    code = textwrap.dedent(
        f"""
        import torch, tiersave
        state = {{"w": torch.ones(1 << 20, dtype=torch.float32)}}  # 4 MiB
        with tiersave.Checkpointer({str(root)!r}) as ckpt:
            ckpt.save(1, state)
        """
    )
    env = {**os.environ, "TIERSAVE_IO": "direct", "TIERSAVE_CRASHPOINT": "after_shard_write"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    shards = [p for p in root.rglob("*.bin") if ".tmp-" in str(p.parent.name)]
    assert shards, sorted(root.rglob("*"))
    for shard in shards:
        file_size, blocks = allocated(shard)
        assert file_size <= (4 << 20) + 4096 and blocks <= (4 << 20) + 4096, (shard, file_size, blocks)
