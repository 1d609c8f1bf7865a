"""LocalBlobReader.read_ranges and storage.posix.vectored: a run of consecutive ranges read with a few large
vectored requests, byte-exact for every mix of aligned and unaligned buffers, odd lengths, padding and gaps,
direct and buffered; the file ending early, overlapping ranges and a refused direct read. On the ext4 work
disk (tmp_path), where O_DIRECT enforces alignment. Every storage here is opened with a forced path (io=
"direct" or "buffered"), so no calibration is read or run."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import numpy as np
import pytest

from tiersave.errors import CorruptCheckpointError
from tiersave.storage.base import RangesReader
from tiersave.storage.posix import LocalStorage, filesystem_type, vectored
from tiersave.storage.posix.buffers import address_of, aligned_buffer
from tiersave.storage.posix.directio import BouncePool, DioAlignment, pread_direct


@pytest.fixture
def ext4(tmp_path: Path) -> Path:
    if filesystem_type(tmp_path) in ("tmpfs", "ramfs", ""):
        pytest.skip("needs a block-device file system for O_DIRECT alignment rules")
    return tmp_path


def _dest(n: int, kind: str) -> memoryview:
    """A buffer of n bytes: page-aligned, or 64 bytes past a page (where torch puts a large tensor)."""
    if kind == "aligned":
        return aligned_buffer(n)
    buf = aligned_buffer(n + 64)[64:]
    assert address_of(buf) % 512 == 64 % 512 if n else True
    return buf


def _layout(seed: int, count: int) -> list[tuple[int, int]]:
    """(offset, length) of ``count`` ranges: tensor-like sizes, mostly at 4 KiB-aligned offsets one after the
    other, some odd offsets, some gaps."""
    rng = random.Random(seed)
    pos = rng.choice([0, 4096, 100])
    out = []
    for _ in range(count):
        n = rng.choice([1, 4095, 4096, 9000, 1 << 20, (1 << 20) + 3, 3 << 20, 4 << 20])
        out.append((pos, n))
        pos += n
        pos = rng.choice([-(-pos // 4096) * 4096, pos, pos + 13, -(-pos // 4096) * 4096 + 8192])
    return out


def _file(path: Path, size: int) -> bytes:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("mode", ["direct", "buffered"])
@pytest.mark.parametrize("dest", ["aligned", "unaligned", "mixed"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_read_ranges_fills_every_range_byte_exact(ext4: Path, mode: str, dest: str, seed: int) -> None:
    layout = _layout(seed, 12)
    end = layout[-1][0] + layout[-1][1]
    data = _file(ext4 / "shard", end)  # the last range ends the file, off a block boundary mostly
    storage = LocalStorage(ext4, io=mode)
    rng = random.Random(seed)
    outs = [_dest(n, dest if dest != "mixed" else rng.choice(["aligned", "unaligned"])) for _, n in layout]
    with storage.open_reader("shard") as reader:
        assert isinstance(reader, RangesReader)
        reader.read_ranges(list(zip((off for off, _ in layout), outs, strict=True)))
        paths = reader.io_stats.bytes_by_path()
    for (off, n), out in zip(layout, outs, strict=True):
        assert bytes(out) == data[off : off + n], f"range at {off} ({n} B)"
    assert sum(paths.values()) == sum(n for _, n in layout)
    if mode == "buffered":
        assert set(paths) == {"buffered"}
    elif dest == "aligned":  # what starts on a block lands in place, but for its unaligned tail
        assert paths.get("direct", 0) == sum(n - n % 4096 for off, n in layout if off % 4096 == 0)


def _count_preadv(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the real preadv calls of the vectored reader (the calls go through unchanged)."""
    calls: list[int] = []
    real = os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(vectored.os, "preadv", counting)
    return calls


def test_a_run_of_aligned_tensors_is_one_request_straight_into_them(
    ext4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mib = 1 << 20
    data = _file(ext4 / "shard", 16 * mib)
    outs = [aligned_buffer(mib) for _ in range(16)]
    calls = _count_preadv(monkeypatch)
    storage = LocalStorage(ext4, io="direct")
    with storage.open_reader("shard") as reader:
        reader.read_ranges([(i * mib, out) for i, out in enumerate(outs)])
        assert reader.io_stats.bytes_by_path() == {"direct": 16 * mib}
    assert calls == [16]  # one preadv, one buffer per tensor, no bounce
    assert all(bytes(out) == data[i * mib : (i + 1) * mib] for i, out in enumerate(outs))


def test_unaligned_destinations_bounce_in_large_requests(ext4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mib = 1 << 20
    data = _file(ext4 / "shard", 32 * mib)
    outs = [_dest(4 * mib, "unaligned") for _ in range(8)]
    calls = _count_preadv(monkeypatch)
    pool = BouncePool(8 * mib)
    fd = os.open(ext4 / "shard", os.O_RDONLY | os.O_DIRECT)
    try:
        in_place, bounced, end = vectored.pread_ranges_direct(
            fd, [(i * 4 * mib, out) for i, out in enumerate(outs)], DioAlignment(512, 4096), pool
        )
    finally:
        os.close(fd)
    assert (in_place, bounced, end) == (0, 32 * mib, 32 * mib)
    assert len(calls) == 4  # 8 MiB (the bounce block) per request, not one request per 4 MiB tensor
    assert all(bytes(out) == data[i * 4 * mib : (i + 1) * 4 * mib] for i, out in enumerate(outs))


def test_vectored_and_single_reads_agree_on_a_torn_layout(ext4: Path) -> None:
    """Every piece of a range: aligned head in place, unaligned tail bounced, padding skipped."""
    data = _file(ext4 / "shard", 10 * 4096 + 77)
    layout = [(0, 4096 + 5), (8192, 3 * 4096), (5 * 4096 + 100, 4096), (8 * 4096, 2 * 4096 + 77)]
    outs = [aligned_buffer(n) for _, n in layout]
    fd = os.open(ext4 / "shard", os.O_RDONLY | os.O_DIRECT)
    try:
        pool = BouncePool(4096)  # one block of bounce per request: forces several requests
        _, _, end = vectored.pread_ranges_direct(
            fd, list(zip((o for o, _ in layout), outs)), DioAlignment(512, 4096), pool
        )
        single = [aligned_buffer(n) for _, n in layout]
        for (off, _), out in zip(layout, single, strict=True):
            pread_direct(fd, out, off, DioAlignment(512, 4096), pool)
    finally:
        os.close(fd)
    assert end == len(data)
    for (off, n), a, b in zip(layout, outs, single, strict=True):
        assert bytes(a) == bytes(b) == data[off : off + n]


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_a_file_shorter_than_the_ranges_is_corrupt_and_named(ext4: Path, mode: str) -> None:
    _file(ext4 / "shard", 3 * 4096 + 10)
    storage = LocalStorage(ext4, io=mode)
    with storage.open_reader("shard") as reader, pytest.raises(CorruptCheckpointError, match="ends before byte"):
        reader.read_ranges([(0, aligned_buffer(8192)), (8192, aligned_buffer(8192))])


def test_overlapping_ranges_are_refused(ext4: Path) -> None:
    _file(ext4 / "shard", 4 * 4096)
    fd = os.open(ext4 / "shard", os.O_RDONLY | os.O_DIRECT)
    try:
        with pytest.raises(ValueError, match="overlap or are not sorted at file offset 4096"):
            vectored.pread_ranges_direct(
                fd, [(0, aligned_buffer(8192)), (4096, aligned_buffer(4096))], DioAlignment(512, 4096), BouncePool()
            )
    finally:
        os.close(fd)


def test_a_refused_vectored_read_falls_back_to_buffered(ext4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _file(ext4 / "shard", 4 * 4096)
    storage = LocalStorage(ext4, io="direct")

    def refuse(*args: object, **kwargs: object) -> tuple[int, int, int]:
        raise OSError(errno.EINVAL, "Invalid argument")

    from tiersave.storage.posix import blobs

    monkeypatch.setattr(blobs, "pread_ranges_direct", refuse)
    outs = [aligned_buffer(8192), aligned_buffer(8192)]
    with storage.open_reader("shard") as reader:
        reader.read_ranges([(0, outs[0]), (8192, outs[1])])
        assert reader.io_stats.bytes_by_path() == {"buffered": 4 * 4096}
    assert bytes(outs[0]) + bytes(outs[1]) == data
    assert storage.io_policy.refused
