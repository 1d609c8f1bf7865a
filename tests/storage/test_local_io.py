"""LocalStorage's direct/buffered/auto I/O: every path, byte-exact, for sizes around the 4 KiB block
boundary, aligned and unaligned memory and offsets, on ext4 (the work disk), tmpfs (/dev/shm), ramfs
(a real file system that refuses O_DIRECT, mounted when the tests run as root) and ext4 with the refusal
injected; fallbacks, error paths, and Checkpointer round trips in each mode."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import assert_same
from tiersave import Checkpointer
from tiersave.errors import CorruptCheckpointError, FormatError, StorageError
from tiersave.format.layout import align_up
from tiersave.storage.posix import LocalStorage, blobs, filesystem_type, local
from tiersave.storage.posix.buffers import aligned_buffer
from tiersave.storage.posix.calibration import Calibration, forget_calibrations
from tiersave.storage.posix.directio import refuse_direct_io

SIZES = [0, 1, 4095, 4096, 4097, 3 * 4096 + 1, (1 << 20) + 4097]
MODES = ["direct", "buffered", "auto"]
FILESYSTEMS = ["ext4", "tmpfs", "ramfs", "refused"]


@pytest.fixture(autouse=True)
def no_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Auto runs uncalibrated (direct on block devices) unless a test passes a calibration."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("TIERSAVE_IO_CALIBRATE", "0")
    monkeypatch.delenv("TIERSAVE_IO", raising=False)
    forget_calibrations()
    yield
    forget_calibrations()


@contextlib.contextmanager
def _ramfs(base: Path) -> Iterator[Path]:
    mnt = base / "ramfs"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot mount ramfs here (needs root): the refusal is covered by the 'refused' case")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=10)


@pytest.fixture(params=FILESYSTEMS)
def fs_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    kind: str = request.param
    if kind == "ext4":
        if filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
            pytest.skip("tmp_path is not on a block device")
        yield kind, tmp_path
    elif kind == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        path = Path(tempfile.mkdtemp(prefix="tiersave-test-", dir="/dev/shm"))
        try:
            yield kind, path
        finally:
            shutil.rmtree(path, ignore_errors=True)
    elif kind == "ramfs":
        with _ramfs(tmp_path) as mnt:
            yield kind, mnt
    else:  # ext4 where every O_DIRECT open is refused, as on a file system without support
        with refuse_direct_io():
            yield kind, tmp_path


def payload(n: int, seed: int = 7) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def buffer(data: bytes | int, aligned: bool) -> memoryview:
    n = data if isinstance(data, int) else len(data)
    view = aligned_buffer(n) if aligned else aligned_buffer(n + 64)[64 : 64 + n]
    if not isinstance(data, int):
        view[:] = data
    return view


def expected_paths(kind: str, mode: str) -> set[str]:
    """Which I/O paths may carry bytes on this file system in this mode."""
    if kind in ("ramfs", "refused") or mode == "buffered" or (kind == "tmpfs" and mode == "auto"):
        return {"buffered"}
    return {"direct", "direct-bounce", "blocks", "buffered"}


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_every_size_offset_and_alignment(fs_dir: tuple[str, Path], mode: str) -> None:
    kind, root = fs_dir
    storage = LocalStorage(root / "s", io=mode)
    if kind == "ramfs":
        assert storage.fstype == "ramfs" and not storage.capabilities.direct_io
    for size in SIZES:
        for offset in (0, 4096 + 100):
            for src_aligned in (True, False):
                data = payload(size, seed=size + offset)
                key = f"f-{size}-{offset}-{int(src_aligned)}"
                writer = storage.open_writer(key)
                writer.write_at(offset, buffer(data, src_aligned))
                final = align_up(offset + size) if src_aligned else offset + size  # padded and exact lengths
                writer.finish(final)
                on_disk = (storage.root / key).read_bytes()
                assert len(on_disk) == final, key
                assert on_disk[:offset] == b"\0" * offset and on_disk[offset : offset + size] == data, key
                assert on_disk[offset + size :] == b"\0" * (final - offset - size), key
                used = set(writer.io_stats.bytes_by_path())
                assert used <= expected_paths(kind, mode), (key, used)
                with storage.open_reader(key) as reader:
                    assert reader.size == final
                    for dest_aligned in (True, False):
                        out = buffer(size, dest_aligned)
                        reader.read_into(offset, out)
                        assert bytes(out) == data, (key, dest_aligned)
                    used = set(reader.io_stats.bytes_by_path())
                    assert used <= expected_paths(kind, mode), (key, used)
    totals = storage.io_stats.bytes_by_path()
    if kind == "ext4" and mode != "buffered":
        assert totals.get("direct", 0) + totals.get("direct-bounce", 0) > 0  # really went direct
    if kind in ("ramfs", "refused") and mode != "buffered":
        assert storage.io_policy.refused
        assert set(storage.io_stats.reasons) == {"direct-refused"}
    if kind == "tmpfs" and mode == "auto":
        assert set(storage.io_stats.reasons) == {"memory-fs"}


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_disjoint_writes_equal_a_buffered_write(tmp_path: Path, mode: str, seed: int) -> None:
    """Many threads, pieces of every size and alignment, several per block: the bytes a plain writer gives."""
    rng = random.Random(seed)
    pieces: list[tuple[int, bytes]] = []
    pos = 0
    while pos < 3 << 20:
        n = rng.choice([1, 7, 100, 4095, 4096, 4097, 9000, 70_000, 300_000])
        pos += rng.choice([0, 0, 1, 13, 4096])
        pieces.append((pos, payload(n, seed=pos)))
        pos += n
    expected = bytearray(pos)
    for off, b in pieces:
        expected[off : off + len(b)] = b
    storage = LocalStorage(tmp_path, io=mode)
    writer = storage.open_writer("shard")
    rng.shuffle(pieces)
    with ThreadPoolExecutor(6) as ex:
        list(ex.map(lambda p: writer.write_at(p[0], buffer(p[1], rng.random() < 0.5)), pieces))
    writer.finish(len(expected))
    assert (tmp_path / "shard").read_bytes() == bytes(expected)
    with storage.open_reader("shard") as reader:
        out = buffer(len(expected), False)
        with ThreadPoolExecutor(4) as ex:
            step = 1 << 20
            list(ex.map(lambda o: reader.read_into(o, out[o : o + step]), range(0, len(expected), step)))
        assert bytes(out) == bytes(expected)


def test_many_tiny_edges_switch_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blobs, "_MAX_PENDING_BYTES", 3 * 4096)
    storage = LocalStorage(tmp_path, io="direct")
    writer = storage.open_writer("f")
    expected = bytearray(20 * 4096)
    for i in range(20):  # one unaligned piece per block: more pending blocks than allowed
        off = i * 4096 + 10
        writer.write_at(off, memoryview(bytes([i + 1]) * 50))
        expected[off : off + 50] = bytes([i + 1]) * 50
    writer.write_at(4096 * 20, buffer(payload(8192), True))  # whole blocks still go direct
    expected += payload(8192)
    writer.finish(len(expected))
    assert (tmp_path / "f").read_bytes() == bytes(expected)
    paths = writer.io_stats.bytes_by_path()
    assert paths["buffered"] >= 20 * 50 and paths["direct"] == 8192


def test_direct_write_refused_midway_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = LocalStorage(tmp_path, io="direct")
    writer = storage.open_writer("f")

    def refuse(*args: object, **kwargs: object) -> bool:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(blobs, "pwrite_direct", refuse)
    data = payload(5 * 4096 + 3)
    writer.write_at(0, buffer(data, True))
    writer.finish(len(data))
    assert (tmp_path / "f").read_bytes() == data
    assert storage.io_policy.refused
    assert writer.io_stats.bytes_by_path() == {"buffered": len(data)}  # the edge block too, once refused
    assert storage.io_policy.decide("write", 1 << 30, aligned=True).reason == "direct-refused"


def test_direct_read_refused_midway_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = payload(3 * 4096)
    (tmp_path / "f").write_bytes(data)
    storage = LocalStorage(tmp_path, io="direct")

    def refuse(*args: object, **kwargs: object) -> tuple[int, int]:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    with storage.open_reader("f") as reader:
        monkeypatch.setattr(blobs, "pread_direct", refuse)
        out = buffer(len(data), True)
        reader.read_into(0, out)
        assert bytes(out) == data
        assert reader.io_stats.bytes_by_path() == {"buffered": len(data)}


def test_a_real_direct_write_error_is_raised_not_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = LocalStorage(tmp_path, io="direct")
    writer = storage.open_writer("f")

    def fail(*args: object, **kwargs: object) -> bool:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(blobs, "pwrite_direct", fail)
    with pytest.raises(StorageError, match="Input/output error"):
        writer.write_at(0, buffer(4096, True))
    assert not storage.io_policy.refused
    writer.abort()
    assert not (tmp_path / "f").exists()


def test_fsync_failure_is_reported_once_and_never_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = LocalStorage(tmp_path, io="direct")
    writer = storage.open_writer("f")
    writer.write_at(0, buffer(payload(8192 + 5), False))
    calls = []

    def failing_fsync(fd: int) -> None:
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StorageError, match="syncing"):
        writer.finish(8192 + 5)
    monkeypatch.undo()
    assert len(calls) == 1
    with pytest.raises(StorageError, match="finish after abort"):
        writer.finish(8192 + 5)  # the descriptor is gone: no second fsync can "succeed"
    writer.abort()


def test_reading_past_the_end_is_corruption_on_every_path(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(payload(5000))
    for mode in MODES:
        storage = LocalStorage(tmp_path, io=mode, min_direct_bytes=0)
        with storage.open_reader("f") as reader:
            for offset, n in ((0, 8192), (4096, 4096), (4999, 2)):
                with pytest.raises(CorruptCheckpointError, match="ends before byte"):
                    reader.read_into(offset, buffer(n, True))


def test_direct_descriptor_must_be_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other"
    other.write_bytes(b"x")
    real_open = local.open_direct
    monkeypatch.setattr(local, "open_direct", lambda path, flags, **kw: real_open(other, os.O_RDONLY))
    storage = LocalStorage(tmp_path / "s", io="direct")
    with pytest.raises(FormatError, match="was replaced"):
        storage.open_writer("f")
    assert not (storage.root / "f").exists()  # the half-opened writer removed its file
    (storage.root / "g").write_bytes(b"y")
    with pytest.raises(FormatError, match="was replaced"):
        storage.open_reader("g")


def test_symlinked_shard_is_refused_in_direct_mode(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "s", io="direct")
    (tmp_path / "target").write_bytes(payload(4096))
    (storage.root / "link").symlink_to(tmp_path / "target")
    with pytest.raises(FormatError, match="symbolic link"):
        storage.open_reader("link")


def test_preallocation_is_trimmed_to_the_final_size(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path, io="direct")
    writer = storage.open_writer("f")
    writer.write_at(0, buffer(payload(1 << 20), True))  # reserves ahead of what was written
    writer.finish((1 << 20) + 4096)
    st = os.stat(tmp_path / "f")
    assert st.st_size == (1 << 20) + 4096
    assert st.st_blocks * 512 < 8 << 20  # the reservation beyond the size was released


def test_io_stats_roll_up_into_the_storage(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path, io="direct")
    writer = storage.open_writer("f")
    writer.write_at(0, buffer(payload(4 * 4096), True))
    writer.finish(4 * 4096)
    with storage.open_reader("f") as reader:
        reader.read_into(0, buffer(4 * 4096, False))
    data = storage.io_stats.to_json()
    assert data["paths"]["direct"]["bytes"] == 4 * 4096  # the write, in place
    assert data["paths"]["direct-bounce"]["bytes"] == 4 * 4096  # the read into unaligned memory
    assert data["reasons"] == {"forced-direct": 2}


def test_auto_decisions_show_up_in_the_stats(tmp_path: Path) -> None:
    fast_buffered_reads = Calibration("k", 2.0, 0.3, 1.0, 5.0, 10.0, 1 << 20, 4, 0.0)
    storage = LocalStorage(tmp_path, io="auto", calibration=fast_buffered_reads, min_direct_bytes=1 << 20)
    data = payload(3 << 20)
    writer = storage.open_writer("f")
    writer.write_at(0, buffer(data, True))
    writer.finish(len(data))
    with storage.open_reader("f") as reader:
        reader.read_into(0, buffer(3 << 20, True))
        reader.read_into(0, buffer(100, True))
    assert storage.io_stats.reasons == {"calibrated": 2, "small": 1}
    assert storage.io_stats.bytes_by_path() == {"direct": len(data), "buffered": len(data) + 100}


def test_tmpfs_auto_opens_no_direct_descriptor() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    root = Path(tempfile.mkdtemp(prefix="tiersave-test-", dir="/dev/shm"))
    try:
        storage = LocalStorage(root, io="auto")
        writer = storage.open_writer("f")
        assert not writer.direct
        writer.write_at(0, buffer(payload(2 << 20), False))
        writer.finish(2 << 20)
        assert writer.io_stats.bytes_by_path() == {"buffered": 2 << 20}
        assert "io='auto'" in repr(storage)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_invalid_io_options() -> None:
    with pytest.raises(ValueError, match="io must be one of"):
        LocalStorage("/tmp", io="sometimes")
    with pytest.raises(ValueError, match="min_direct_bytes"):
        LocalStorage("/tmp", min_direct_bytes=-1)


# -- end to end --------------------------------------------------------------------------------------


def odd_state() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    return {
        "empty": torch.empty(0),
        "byte": torch.tensor([7], dtype=torch.uint8),
        "almost_block": torch.rand(1023, generator=g),  # 4092 bytes
        "block": torch.rand(1024, generator=g),
        "past_block": torch.rand(1025, generator=g),
        "odd": torch.rand(37, 113, generator=g).to(torch.float64),
        "big": torch.rand(700_001, generator=g),  # 2.8 MB, unaligned end, over the 1 MiB small-read limit
        "bf16": torch.rand(3, 5, 7, generator=g).to(torch.bfloat16),
        "step": 12,
    }


@pytest.mark.parametrize("mode", MODES)
def test_checkpointer_round_trip_in_each_io_mode(fs_dir: tuple[str, Path], mode: str) -> None:
    _, root = fs_dir
    state = odd_state()
    storage = LocalStorage(root / "ckpt", io=mode)
    with Checkpointer(storage, chunk_bytes=1 << 20) as ckpt:
        ckpt.save(1, state)
        assert_same(ckpt.restore(1), state)
        live = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
        ckpt.restore(1, into=live)
        assert_same(live, state)
        assert ckpt.verify(1).ok


@pytest.mark.parametrize("mode", MODES)
def test_tiersave_io_env_selects_the_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("TIERSAVE_IO", mode)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        storage = ckpt.storage
        assert isinstance(storage, LocalStorage) and storage.io_mode.value == mode
        ckpt.save(1, odd_state())
        assert_same(ckpt.restore(1), odd_state())
        used = storage.io_stats.bytes_by_path()
        if mode == "buffered":
            assert set(used) == {"buffered"}
        else:
            assert used.get("direct", 0) + used.get("direct-bounce", 0) > 0
