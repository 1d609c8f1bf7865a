"""storage.posix.directio: alignment splits, O_DIRECT open and refusal, bounce buffers, direct reads and writes
around block boundaries, merged write edges, preallocation. On the ext4 work disk (tmp_path), where
O_DIRECT enforces alignment (tmpfs accepts it and ignores alignment, so it proves nothing here)."""

from __future__ import annotations

import errno
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import random_bytes as payload
from tiersave.storage.posix import directio
from tiersave.storage.posix.buffers import address_of, aligned_buffer
from tiersave.storage.posix.directio import (
    BouncePool,
    DioAlignment,
    PartialBlocks,
    dio_alignment,
    open_direct,
    pread_direct,
    preallocate,
    probe_direct_io,
    pwrite_direct,
    refuse_direct_io,
    split_aligned,
)

SIZES = [0, 1, 4095, 4096, 4097, 8191, 8192, 65536 + 3, (1 << 20) + 4097]
A = DioAlignment(4096, 4096)


def unaligned(n: int, shift: int = 64) -> memoryview:
    """A writable view of ``n`` bytes whose address is ``shift`` past a page boundary."""
    return aligned_buffer(n + shift)[shift : shift + n]


@pytest.mark.parametrize(
    ("offset", "length", "expected"),
    [
        (0, 0, (0, 0, 0)),
        (0, 1, (1, 0, 0)),
        (0, 4095, (4095, 0, 0)),
        (0, 4096, (0, 4096, 0)),
        (0, 4097, (0, 4096, 1)),
        (1, 4096, (4096, 0, 0)),  # no whole block inside: all head
        (100, 50, (50, 0, 0)),
        (4000, 200, (200, 0, 0)),
        (4000, 8192, (96, 4096, 4000)),
        (8192, 3 * 4096, (0, 3 * 4096, 0)),
    ],
)
def test_split_aligned(offset: int, length: int, expected: tuple[int, int, int]) -> None:
    head, middle, tail = split_aligned(offset, length, 4096)
    assert (head, middle, tail) == expected
    assert head + middle + tail == length
    if middle:
        assert (offset + head) % 4096 == 0 and middle % 4096 == 0


def test_alignment_from_statx_is_never_below_a_page(ext4_dir: Path) -> None:
    path = ext4_dir / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        al = dio_alignment(fd)
    finally:
        os.close(fd)
    assert al.offset >= 4096 and al.offset % 512 == 0
    assert al.memory >= 1 and al.memory & (al.memory - 1) == 0


def test_open_direct_and_refusal_hook(ext4_dir: Path) -> None:
    path = ext4_dir / "f"
    path.write_bytes(b"x" * 4096)
    fd = open_direct(path, os.O_RDONLY)
    assert fd is not None
    os.close(fd)
    with refuse_direct_io():
        assert open_direct(path, os.O_RDONLY) is None
        assert probe_direct_io(ext4_dir) is False
    assert probe_direct_io(ext4_dir) is True
    assert not list(ext4_dir.glob(".tiersave-dio-probe-*"))  # the probe cleans up
    with pytest.raises(FileNotFoundError):
        open_direct(ext4_dir / "missing", os.O_RDONLY)


def test_open_direct_never_follows_a_symlink(ext4_dir: Path) -> None:
    (ext4_dir / "target").write_bytes(b"x" * 4096)
    (ext4_dir / "link").symlink_to(ext4_dir / "target")
    with pytest.raises(OSError, match="Too many levels of symbolic links") as info:
        open_direct(ext4_dir / "link", os.O_RDONLY)
    assert info.value.errno == errno.ELOOP


def test_direct_write_really_needs_alignment_on_this_disk(ext4_dir: Path) -> None:
    """The premise of the bounce buffers: an unaligned source is refused by the kernel (EINVAL)."""
    fd = open_direct(ext4_dir / "f", os.O_WRONLY | os.O_CREAT)
    assert fd is not None
    try:
        with pytest.raises(OSError, match="Invalid argument") as info:
            os.pwrite(fd, unaligned(4096, 64), 0)
        assert info.value.errno == errno.EINVAL
        assert os.pwrite(fd, aligned_buffer(4096), 0) == 4096
    finally:
        os.close(fd)


def test_bounce_pool_reuses_and_bounds_idle_buffers() -> None:
    pool = BouncePool(8192, max_idle=2)
    with pool.acquire() as a:
        assert len(a) == 8192 and address_of(a) % 4096 == 0
        first = address_of(a)
    with pool.acquire() as b:
        assert address_of(b) == first  # reused
    held = []
    for _ in range(5):
        cm = pool.acquire()
        held.append((cm, cm.__enter__()))
    for cm, _ in held:
        cm.__exit__(None, None, None)
    assert pool.idle_bytes() == 2 * 8192
    with pytest.raises(ValueError, match="multiple of 4096"):
        BouncePool(1000)


def test_bounce_pool_is_thread_safe() -> None:
    pool = BouncePool(4096, max_idle=4)
    seen: set[int] = set()
    lock = threading.Lock()

    def use(i: int) -> None:
        with pool.acquire() as buf:
            buf[:8] = i.to_bytes(8, "little")
            assert int.from_bytes(buf[:8], "little") == i  # nobody else holds this buffer
            with lock:
                seen.add(address_of(buf))

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(use, range(200)))
    assert pool.idle_bytes() <= 4 * 4096


@pytest.mark.parametrize("blocks", [1, 3, 64])
@pytest.mark.parametrize("source", ["aligned", "unaligned"])
def test_pwrite_direct_in_place_or_bounced(ext4_dir: Path, blocks: int, source: str) -> None:
    n = blocks * 4096
    data = payload(n)
    src = aligned_buffer(n) if source == "aligned" else unaligned(n)
    src[:] = data
    path = ext4_dir / "f"
    fd = open_direct(path, os.O_WRONLY | os.O_CREAT)
    assert fd is not None
    try:
        bounced = pwrite_direct(fd, src, 8192, A, BouncePool(8192))
    finally:
        os.close(fd)
    assert bounced == (source == "unaligned")
    assert path.read_bytes() == b"\0" * 8192 + data


def test_pwrite_direct_rejects_unaligned_ranges(ext4_dir: Path) -> None:
    fd = open_direct(ext4_dir / "f", os.O_WRONLY | os.O_CREAT)
    assert fd is not None
    try:
        with pytest.raises(ValueError, match="not 4096-aligned"):
            pwrite_direct(fd, aligned_buffer(4096), 100, A, BouncePool())
        with pytest.raises(ValueError, match="not 4096-aligned"):
            pwrite_direct(fd, aligned_buffer(4000), 0, A, BouncePool())
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 4097])
@pytest.mark.parametrize("dest", ["aligned", "congruent", "unaligned"])
def test_pread_direct_any_range_any_destination(ext4_dir: Path, size: int, offset: int, dest: str) -> None:
    file_bytes = payload(offset + size + 5000, seed=size + offset)
    path = ext4_dir / "f"
    path.write_bytes(file_bytes)
    if dest == "aligned":
        out = aligned_buffer(size)
    elif dest == "congruent":  # address and offset agree modulo 4096: the middle lands in place
        out = unaligned(size, offset % 4096) if offset % 4096 else aligned_buffer(size)
    else:
        out = unaligned(size, 64)
    fd = open_direct(path, os.O_RDONLY)
    assert fd is not None
    try:
        filled, bounced = pread_direct(fd, out, offset, A, BouncePool(8192))
    finally:
        os.close(fd)
    assert filled == size
    assert bytes(out) == file_bytes[offset : offset + size]
    head, middle, _ = split_aligned(offset, size, 4096)
    if middle and (address_of(out) + head) % 4096 == 0:
        assert bounced == size - middle  # the aligned middle went straight into ``out``
    else:
        assert bounced == size


@pytest.mark.parametrize("file_size", [0, 100, 4096, 5000, 3 * 4096])
def test_pread_direct_stops_at_end_of_file(ext4_dir: Path, file_size: int) -> None:
    data = payload(file_size)
    path = ext4_dir / "f"
    path.write_bytes(data)
    fd = open_direct(path, os.O_RDONLY)
    assert fd is not None
    try:
        for offset in (0, 50, 4096):
            out = aligned_buffer(4 * 4096)
            filled, _ = pread_direct(fd, out, offset, A, BouncePool(4096))
            assert filled == max(0, file_size - offset)
            assert bytes(out[:filled]) == data[offset:]
    finally:
        os.close(fd)


def test_partial_blocks_merge_pieces_like_a_buffered_writer(ext4_dir: Path, seed: int) -> None:
    rng = random.Random(seed)
    size = 40_000
    pieces: list[tuple[int, bytes]] = []
    pos = rng.randrange(0, 300)
    while pos < size:  # disjoint pieces with gaps, many sharing blocks
        n = rng.randrange(1, 3000)
        pieces.append((pos, payload(n, seed=pos)))
        pos += n + rng.randrange(0, 2000)
    expected = bytearray(max(off + len(b) for off, b in pieces))
    for off, b in pieces:
        expected[off : off + len(b)] = b
    edges = PartialBlocks(4096)
    rng.shuffle(pieces)
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda p: edges.add(p[0], memoryview(p[1])), pieces))
    runs = list(edges.runs())
    starts = [off for off, _ in runs]
    assert starts == sorted(starts) and all(off % 4096 == 0 for off in starts)
    direct_path, buffered_path = ext4_dir / "direct", ext4_dir / "buffered"
    fd = open_direct(direct_path, os.O_WRONLY | os.O_CREAT)
    assert fd is not None
    try:
        written = edges.flush_direct(fd, A, BouncePool(8192))
        os.ftruncate(fd, len(expected))
    finally:
        os.close(fd)
    assert written % 4096 == 0 and len(edges) == 0
    assert direct_path.read_bytes() == bytes(expected)
    for off, b in pieces:
        edges.add(off, memoryview(b))
    fd = os.open(buffered_path, os.O_WRONLY | os.O_CREAT)
    try:
        assert edges.flush_buffered(fd) == sum(len(b) for _, b in pieces)
    finally:
        os.close(fd)
    assert buffered_path.read_bytes() == bytes(expected)


def test_preallocate_extends_the_file_with_zeros(ext4_dir: Path) -> None:
    path = ext4_dir / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        assert preallocate(fd, 0, 1 << 20)
        assert os.fstat(fd).st_size == 1 << 20
        assert os.fstat(fd).st_blocks * 512 >= 1 << 20  # really allocated, not a hole
        assert os.pread(fd, 4096, 12345) == b"\0" * 4096
        assert preallocate(fd, 0, 0) is False
    finally:
        os.close(fd)


def test_preallocate_reports_unsupported_instead_of_failing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(directio, "_fallocate", None)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        assert preallocate(fd, 0, 4096) is False
    finally:
        os.close(fd)
