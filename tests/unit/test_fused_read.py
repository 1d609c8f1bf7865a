"""A restore's bounced bytes are checksummed as they are copied out, in one pass (issue 16).

``LocalBlobReader.read_into_crc`` returns the CRC-32C of what it filled: bounced bytes checksummed piece by
piece right after their copy out of the bounce buffer, bytes read in place after they landed, buffered
reads after the read. The engine's reader uses it for whole checksum chunks; the check must stay exactly as
strict (a flipped byte names tensor and chunk, a short shard is an error) and every byte must land.
Real files on the real POSIX storage with O_DIRECT (``/tmp`` is ext4 here).
"""

from __future__ import annotations

import errno
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

from helpers import random_bytes as _payload
from tiersave import Checkpointer
from tiersave.errors import CorruptCheckpointError
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage, directio, vectored
from tiersave.storage.posix.blobs import ChecksumSink, LocalBlobReader
from tiersave.storage.posix.buffers import address_of, aligned_buffer

MiB = 1 << 20


def _dest(size: int, kind: str, offset: int) -> memoryview:
    if kind == "aligned":
        return aligned_buffer(size)
    if kind == "congruent":  # address and file offset agree modulo a page: the aligned middle lands in place
        shift = offset % 4096
        return aligned_buffer(size + shift)[shift : shift + size]
    return aligned_buffer(size + 64)[64 : 64 + size]  # where torch storages start: 64 B past a page


# sizes across the 256 KiB fused pieces and the 8 MiB bounce buffers, offsets on and off a block
@pytest.mark.parametrize("size", [1, 4095, 4097, (256 << 10) - 1, (256 << 10) + 4097, 9 * MiB + 777])
@pytest.mark.parametrize("offset", [0, 4096, 4096 + 100])
@pytest.mark.parametrize("kind", ["aligned", "congruent", "unaligned"])
def test_read_into_crc_fills_every_byte_and_returns_its_crc(ext4_dir: Path, size: int, offset: int, kind: str) -> None:
    data = _payload(offset + size + 3000, seed=size + offset)
    (ext4_dir / "blob").write_bytes(data)
    storage = LocalStorage(ext4_dir, io="direct")
    try:
        reader = storage.open_reader("blob")
        assert isinstance(reader, LocalBlobReader)
        out = _dest(size, kind, offset)
        with reader:
            crc = reader.read_into_crc(offset, out)
            paths = reader.io_stats.to_json()["paths"]
        want = data[offset : offset + size]
        assert bytes(out) == want
        assert crc == crc32c.crc32c(want)
        assert set(paths) <= {"direct", "direct-bounce"}, paths  # the direct path ran, not a fallback
        if kind == "unaligned":
            assert "direct" not in paths, paths  # all of it went through the fused copy out
    finally:
        storage.close()


@pytest.mark.parametrize("io", ["buffered", "refused"])
def test_read_into_crc_on_the_buffered_path(ext4_dir: Path, io: str) -> None:
    data = _payload(3 * MiB + 5)
    (ext4_dir / "blob").write_bytes(data)
    out = _dest(2 * MiB + 1, "unaligned", 0)
    if io == "refused":  # a file system without O_DIRECT: the reader has no direct descriptor
        with directio.refuse_direct_io():
            storage = LocalStorage(ext4_dir, io="auto")
            reader = storage.open_reader("blob")
    else:
        storage = LocalStorage(ext4_dir, io="buffered")
        reader = storage.open_reader("blob")
    try:
        with reader:
            crc = reader.read_into_crc(4096 + 3, out)  # type: ignore[attr-defined]
        assert bytes(out) == data[4099 : 4099 + len(out)]
        assert crc == crc32c.crc32c(bytes(out))
    finally:
        storage.close()


@pytest.mark.parametrize("io", ["direct", "buffered"])
@pytest.mark.parametrize("pool_bytes", [8192, 8 * MiB])  # many windows of one preadv, or one
def test_read_ranges_crc_gives_each_range_its_crc(ext4_dir: Path, io: str, pool_bytes: int) -> None:
    data = _payload(12 * MiB)
    (ext4_dir / "blob").write_bytes(data)
    # consecutive ranges as a run of tensors lies in a shard: 4 KiB-aligned starts, padding between them,
    # buffers aligned, congruent and unaligned so that in-place parts and bounced ones alternate
    sizes = [300_001, 4096, (256 << 10) + 1, 2 * MiB + 5, 1, 700_000]
    kinds = ["unaligned", "aligned", "congruent", "aligned", "unaligned", "congruent"]
    ranges, pos = [], 8192 + 64
    for size, kind in zip(sizes, kinds, strict=True):
        ranges.append((pos, _dest(size, kind, pos)))
        pos = -(-(pos + size) // 4096) * 4096 + (64 if kind == "aligned" else 0)
    ranges.insert(2, (ranges[1][0] + 4096, memoryview(bytearray(0))))  # an empty range: CRC 0
    storage = LocalStorage(ext4_dir, io=io)
    storage.bounce_pool = directio.BouncePool(pool_bytes)
    try:
        reader = storage.open_reader("blob")
        assert isinstance(reader, LocalBlobReader)
        with reader:
            crcs = reader.read_ranges_crc(ranges)
        for (off, view), crc in zip(ranges, crcs, strict=True):
            assert bytes(view) == data[off : off + len(view)], off
            assert crc == crc32c.crc32c(data[off : off + len(view)]), off
    finally:
        storage.close()


def _refused_on_call(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, nth: int) -> None:
    """The ``nth`` call of ``module.name`` fails as a file system refusing O_DIRECT does (EINVAL)."""
    real, calls = getattr(module, name), [0]

    def refusing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, refusing)


def test_o_direct_refused_midway_checksums_every_byte_once(ext4_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Direct I/O refused after part of a read was already checksummed (the bounced head), and the read done
    again buffered: the CRC restarts, else a good checkpoint would fail its check. Single and vectored reads."""
    data = _payload(3 * MiB)
    (ext4_dir / "blob").write_bytes(data)
    storage = LocalStorage(ext4_dir, io="direct")
    try:
        reader = storage.open_reader("blob")
        assert isinstance(reader, LocalBlobReader)
        off, size = 4096 + 100, MiB + 333
        out = aligned_buffer(size + 4096)[100 : 100 + size]  # congruent: a bounced head, then the middle in place
        _refused_on_call(monkeypatch, directio, "_pread_all", 2)  # the head's read went through; the middle's not
        crc = reader.read_into_crc(off, out)
        monkeypatch.undo()
        assert bytes(out) == data[off : off + size] and crc == crc32c.crc32c(data[off : off + size])
        assert "buffered" in reader.io_stats.to_json()["paths"]
        reader.close()
    finally:
        storage.close()
    storage = LocalStorage(ext4_dir, io="direct")
    storage.bounce_pool = directio.BouncePool(8192)  # many windows: the third preadv is refused
    try:
        reader = storage.open_reader("blob")
        assert isinstance(reader, LocalBlobReader)
        ranges = [(100, _dest(300_000, "unaligned", 100)), (303104 + 64, _dest(500_000, "unaligned", 303104 + 64))]
        _refused_on_call(monkeypatch, vectored, "_preadv_all", 3)
        crcs = reader.read_ranges_crc(ranges)
        monkeypatch.undo()
        for (o, view), c in zip(ranges, crcs, strict=True):
            assert bytes(view) == data[o : o + len(view)] and c == crc32c.crc32c(data[o : o + len(view)]), o
        reader.close()
    finally:
        storage.close()


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_read_into_crc_past_the_end_is_an_error(ext4_dir: Path, io: str) -> None:
    (ext4_dir / "blob").write_bytes(_payload(10_000))
    storage = LocalStorage(ext4_dir, io=io)
    try:
        reader = storage.open_reader("blob")
        assert isinstance(reader, LocalBlobReader)
        with reader, pytest.raises(CorruptCheckpointError, match=r"ends before byte 20100"):
            reader.read_into_crc(100, _dest(20_000, "unaligned", 100))
    finally:
        storage.close()


def test_the_sink_checksums_what_it_copies_in_pieces() -> None:
    src = memoryview(_payload(3 * (256 << 10) + 11))
    dst = _dest(len(src), "unaligned", 0)
    sink = ChecksumSink()
    sink.copy(dst[:1000], src[:1000])
    sink.landed(dst[1000:1000])  # nothing: the CRC does not change
    dst[1000:2000] = src[1000:2000]
    sink.landed(dst[1000:2000])
    sink.copy(dst[2000:], src[2000:])
    assert bytes(dst) == bytes(src)
    assert sink.crc == crc32c.crc32c(bytes(src))


# -- through the checkpointer --------------------------------------------------------------------------


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(16)
    return {
        "emb": torch.randn(5 * MiB // 4 + 3, generator=g),  # several chunks and a ragged last one
        "w": torch.randn(3 * MiB // 4, generator=g),
        "mid": torch.randn(700_001, generator=g, dtype=torch.float64).to(torch.float16),  # one chunk or a run
        "tiny": torch.arange(10, dtype=torch.int32),
        # consecutive tensors of one chunk each (with chunks of 4 MiB): runs, each read with one vectored request
        **{f"expert.{i}": torch.randn((MiB + 100_004 + 8 * i) // 4, generator=g) for i in range(16)},
    }


def _count_fused(monkeypatch: pytest.MonkeyPatch, method: str = "read_into_crc") -> list[int]:
    """Records the bytes (``read_into_crc``) or ranges (``read_ranges_crc``) of each call of ``method``."""
    calls: list[int] = []
    original = getattr(LocalBlobReader, method)

    def counting(self: LocalBlobReader, *args: Any) -> Any:
        calls.append(len(args[-1]))
        return original(self, *args)

    monkeypatch.setattr(LocalBlobReader, method, counting)
    return calls


# chunk sizes that cut the tensors at 4 KiB-aligned and unaligned places: head, middle and tail splits
@pytest.mark.parametrize("chunk_bytes", [256 << 10, 1 * MiB, 1 * MiB + 4096 * 3, 4 * MiB])
def test_restores_are_bit_exact_into_live_and_new_tensors(
    ext4_dir: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    state = _state()
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    assert any(address_of(memoryview(v.numpy()).cast("B")) % 512 for v in live.values())  # the usual torch case
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    fused = _count_fused(monkeypatch)
    runs = _count_fused(monkeypatch, "read_ranges_crc")
    with Checkpointer(LocalStorage(ext4_dir, io="direct"), chunk_bytes=chunk_bytes, event_log=False) as ck:
        ck.save(1, state)
        out = ck.restore(1)
        assert all(torch.equal(out[k], v) for k, v in state.items())
        assert ck.restore(1, into=live) is live
    assert all(live[k].data_ptr() == ptrs[k] and torch.equal(live[k], v) for k, v in state.items())
    assert sum(fused) >= 2 * (state["emb"].nbytes + state["w"].nbytes)  # both restores took the fused path
    if chunk_bytes == 4 * MiB:  # the experts are in runs: their CRCs taken in the vectored reads' copy out
        assert sum(runs) >= 2 * 8


def _flip(root: Path, victim: str, where: int) -> tuple[Path, int]:
    """Flip one bit of ``victim``'s byte ``where``; returns the shard and the flipped byte's file offset."""
    step_dir = next(root.glob("step-*"))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    entry = manifest["tensors"][victim]
    shard = step_dir / manifest["shards"][entry["shard"]]["file"]
    pos = entry["offset"] + where
    with open(shard, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x10]))
    return shard, pos


@pytest.mark.parametrize(
    ("victim", "where", "chunk"),
    [
        ("emb", 5, MiB),  # the first chunk's head
        ("emb", MiB + 4096, MiB),  # a middle chunk
        ("emb", 5 * MiB + 1, MiB),  # the ragged last chunk
        ("expert.2", 3, 4 * MiB),  # a tensor inside a run
        ("expert.3", MiB + 100_000, 4 * MiB),  # the unaligned tail of a tensor in a run
    ],
)
def test_a_flipped_byte_is_named_on_the_fused_path(
    ext4_dir: Path, monkeypatch: pytest.MonkeyPatch, victim: str, where: int, chunk: int
) -> None:
    state = _state()
    with Checkpointer(LocalStorage(ext4_dir, io="direct"), chunk_bytes=chunk, event_log=False) as ck:
        ck.save(1, state)
    shard, pos = _flip(ext4_dir, victim, where)
    index = where // chunk
    fused = _count_fused(monkeypatch, "read_into_crc" if victim == "emb" else "read_ranges_crc")
    nbytes = state[victim].nbytes
    with Checkpointer(LocalStorage(ext4_dir, io="direct"), chunk_bytes=chunk, event_log=False) as ck:
        for into in (None, {k: torch.zeros_like(v) for k, v in state.items()}):
            with pytest.raises(CorruptCheckpointError) as info:
                ck.restore(1, into=into)
            assert info.value.tensor == victim
            message = str(info.value)
            assert f"tensor '{victim}', chunk {index} " in message and shard.name in message
            start = pos - where + index * chunk
            assert f"(bytes {start}..{start + min(chunk, nbytes - index * chunk)})" in message
    assert fused  # the mismatch was found on the fused path


def test_a_truncated_shard_fails_clearly(ext4_dir: Path) -> None:
    state = _state()
    with Checkpointer(LocalStorage(ext4_dir, io="direct"), chunk_bytes=MiB, event_log=False) as ck:
        ck.save(1, state)
    step_dir = next(ext4_dir.glob("step-*"))
    shard = next(p for p in step_dir.iterdir() if p.name.startswith("shard-"))
    with open(shard, "r+b") as f:
        f.truncate(MiB + 100)  # inside "emb"'s second chunk: a short read, not a checksum mismatch
    with Checkpointer(LocalStorage(ext4_dir, io="direct"), chunk_bytes=MiB, event_log=False) as ck:
        for into in (None, {k: torch.zeros_like(v) for k, v in state.items()}):
            with pytest.raises(CorruptCheckpointError, match=shard.name):
                ck.restore(1, into=into)


# -- the memory tier: buffered reads from tmpfs, checksummed after each whole read ---------------------------


@pytest.fixture
def memory() -> Iterator[MemoryStorage]:
    storage = MemoryStorage(f"fused-{uuid.uuid4().hex[:12]}")
    yield storage
    storage.destroy()


@pytest.mark.parametrize("chunk_bytes", [256 << 10, 1 * MiB + 4096 * 3, 4 * MiB])
def test_memory_tier_restores_are_bit_exact_on_the_fused_path(
    memory: MemoryStorage, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    state = _state()
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    fused = _count_fused(monkeypatch)
    with Checkpointer(memory, chunk_bytes=chunk_bytes, event_log=False) as ck:
        ck.save(1, state)
        out = ck.restore(1)
        assert all(torch.equal(out[k], v) for k, v in state.items())
        assert ck.restore(1, into=live) is live
        paths = memory.io_stats.to_json()["paths"]
    assert all(torch.equal(live[k], v) for k, v in state.items())
    assert sum(fused) >= 2 * (state["emb"].nbytes + state["w"].nbytes)
    assert set(paths) == {"buffered"}, paths


def test_memory_tier_names_a_flipped_byte_and_a_short_shard(memory: MemoryStorage) -> None:
    state = _state()
    with Checkpointer(memory, chunk_bytes=MiB, event_log=False) as ck:
        ck.save(1, state)
    root = Path(memory.root)
    shard, _ = _flip(root, "emb", 3 * MiB + 300 * 1024 + 7)  # inside the second 256 KiB piece of chunk 3
    with Checkpointer(memory, chunk_bytes=MiB, event_log=False) as ck, pytest.raises(CorruptCheckpointError) as info:
        ck.restore(1, into={k: torch.zeros_like(v) for k, v in state.items()})
    assert info.value.tensor == "emb" and "tensor 'emb', chunk 3 " in str(info.value)
    with open(shard, "r+b") as f:
        f.truncate(2 * MiB + 100)
    with Checkpointer(memory, chunk_bytes=MiB, event_log=False) as ck, pytest.raises(CorruptCheckpointError) as info:
        ck.restore(1)
    assert shard.name in str(info.value) and "truncated" in str(info.value)  # caught before any read
