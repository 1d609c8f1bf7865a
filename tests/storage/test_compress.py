"""Compressed shards (format 3.0, docs/format.md section 10): drains and copies that write zstd frames with
a byte-plane split, bit-exact restores from them on local and S3 tiers, clean errors for damaged frames,
and readers of older formats refusing them."""

from __future__ import annotations

import json

import pytest
import torch

import tiersave
from helpers import assert_same
from tiersave.catalog import Catalog
from tiersave.drain import copy_checkpoint
from tiersave.engine.codec import plan_frames
from tiersave.errors import ConfigError, CorruptCheckpointError, FormatError, UnsupportedFormatVersionError
from tiersave.format import READ_VERSIONS
from tiersave.format.layout import MANIFEST_NAME, step_dirname
from tiersave.format.manifest import Manifest, seal
from tiersave.storage.posix import LocalStorage


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(1000, 700, generator=g)
    return {
        "fp32": w,  # 2.7 MiB: several 1 MiB chunks and a tail
        "bf16": w[:777, :333].to(torch.bfloat16),
        "fp16": torch.randn(1001, generator=g).to(torch.float16),  # odd size
        "fp64": torch.randn(13, generator=g, dtype=torch.float64),
        "int": torch.randint(-(2**40), 2**40, (4097,), generator=g),
        "bool": torch.rand(999, generator=g) > 0.5,
        "u8": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        "empty": torch.empty(0, 5),
        "zeros": torch.zeros(300_000),  # compresses to almost nothing
        "step": step,
    }


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    with tiersave.Checkpointer(root, chunk_bytes=1 << 20, max_shard_bytes=3 << 20) as ckpt:
        ckpt.save(5, state(5)).result()
    return LocalStorage(root)


def restore(storage, step=5):
    with tiersave.Checkpointer(storage) as ckpt:
        return ckpt.restore(step)


def test_local_round_trip_is_bit_exact_and_smaller(src, tmp_path):
    dst = LocalStorage(tmp_path / "dst")
    result = copy_checkpoint(src, dst, 5, compress="zstd", read_back=True)
    m = Catalog(dst).manifest(5)
    assert all(s.encoding is not None for s in m.shards) and len(m.shards) > 1
    assert m.format_version == "3.0"
    assert result.file_bytes == m.file_bytes < m.stored_bytes == result.stored_bytes
    planes = {f.planes for s in m.shards for f in s.encoding.frames}
    assert {2, 4} <= planes  # bf16/fp16 and fp32 frames were split
    assert Catalog(dst).verify(5).ok
    assert_same(restore(dst), state(5))
    # a copy to a tier without compression decodes: plain shards, 1.x again, same bytes
    plain = LocalStorage(tmp_path / "plain")
    copy_checkpoint(dst, plain, 5, read_back=True)
    back = Catalog(plain).manifest(5)
    assert all(s.encoding is None for s in back.shards) and back.format_version.startswith("1.")
    for a, b in zip(Catalog(src).manifest(5).shards, back.shards):
        src_bytes = (src.root / step_dirname(5) / a.file).read_bytes()
        assert src_bytes == (plain.root / step_dirname(5) / b.file).read_bytes()
    # compressed to compressed re-encodes and stays exact
    again = LocalStorage(tmp_path / "again")
    copy_checkpoint(dst, again, 5, compress="zstd")
    assert_same(restore(again), state(5))


def test_frames_cover_each_chunk_once(src):
    m = Catalog(src).manifest(5)
    for index, shard in enumerate(m.shards):
        frames = plan_frames(m, index)
        assert sum(n for _, n, _ in frames) == shard.size
        assert all(n <= m.chunk_bytes for _, n, _ in frames)
        bounds = [(off, off + n) for off, n, _ in frames]
        for t in m.tensors.values():
            if t.shard == index and t.nbytes:
                for k in range(0, t.nbytes, m.chunk_bytes):
                    lo, hi = t.offset + k, t.offset + min(t.nbytes, k + m.chunk_bytes)
                    assert any(a <= lo and hi <= b for a, b in bounds), (t.name, k)


def chain_saves(tmp_path, compress, steps):
    """Saves through a two-tier chain whose second tier has ``compress``; returns that tier's storage."""
    tiers = [
        tiersave.Tier(tmp_path / "fast", name="fast"),
        tiersave.Tier(tmp_path / "slow", name="slow", compress=compress),
    ]
    with tiersave.Checkpointer(tiers=tiers, chunk_bytes=1 << 20) as ckpt:
        for step in steps:
            ckpt.save(step, state(step)).result()
            assert ckpt.wait(60)
    return LocalStorage(tmp_path / "slow")


def test_drain_to_a_compressed_tier(tmp_path):
    slow = chain_saves(tmp_path, "zstd", [7])
    m = Catalog(slow).manifest(7)
    assert all(s.encoding is not None for s in m.shards)
    assert_same(restore(slow, 7), state(7))


def test_tier_option_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="compress must be one of"):
        tiersave.Tier(tmp_path, compress="gzip")
    with pytest.raises(ConfigError, match="applies to later tiers"):
        tiersave.Checkpointer(tiers=[tiersave.Tier(tmp_path / "a", compress="zstd"), tiersave.Tier(tmp_path / "b")])


def _compressed(src, tmp_path):
    dst = LocalStorage(tmp_path / "dst")
    copy_checkpoint(src, dst, 5, compress="zstd")
    m = Catalog(dst).manifest(5)
    return dst, m, dst.root / step_dirname(5) / m.shards[0].file


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_in_a_frame_is_a_clean_error(src, tmp_path, where):
    dst, m, path = _compressed(src, tmp_path)
    data = bytearray(path.read_bytes())
    frames = m.shards[0].encoding.frames
    index = {"first": 0, "middle": len(frames) // 2, "last": len(frames) - 1}[where]
    at = m.shards[0].encoding.stored_start(index) + frames[index].stored // 2
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"frame {index} .*fail their checksum"):
        restore(dst)
    report = Catalog(dst).verify(5)
    assert not report.ok and "checksum" in report.errors[0]


def test_truncated_shard_is_a_clean_error(src, tmp_path):
    dst, _, path = _compressed(src, tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        restore(dst)


def _edit_manifest(storage, edit):
    path = storage.root / step_dirname(5) / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_bytes(seal(doc))
    return path


def test_frame_declaring_a_huge_size_is_refused_before_reading(src, tmp_path):
    dst, _, _ = _compressed(src, tmp_path)

    def grow(doc):
        doc["shards"][0]["encoding"]["frames"][0][0] = 1 << 40

    path = _edit_manifest(dst, grow)
    with pytest.raises(FormatError, match="decodes to"):
        Manifest.parse(path.read_bytes(), path=str(path))


def test_frame_whose_content_lies_about_its_length(src, tmp_path):
    # A frame whose stored bytes (and CRC) are self-consistent but decode to another length than declared.
    dst, m, _ = _compressed(src, tmp_path)
    frames = m.shards[0].encoding.frames
    index = next(
        i
        for i, f in enumerate(frames[:-1])
        if not f.verbatim and f.raw > 8192 and frames[i + 1].raw + 4096 <= m.chunk_bytes
    )

    def shrink(doc):
        doc["shards"][0]["encoding"]["frames"][index][0] -= 4096
        doc["shards"][0]["encoding"]["frames"][index + 1][0] += 4096

    _edit_manifest(dst, shrink)
    with pytest.raises(CorruptCheckpointError, match=rf"frame ({index}|{index + 1}) .*declares"):
        restore(dst)


def test_older_readers_refuse_format_3(src, tmp_path, monkeypatch):
    dst, _, _ = _compressed(src, tmp_path)
    data = (dst.root / step_dirname(5) / MANIFEST_NAME).read_bytes()
    for known in ({1: 2}, {1: 2, 2: 0}):  # a 1.x reader, a 2.0 reader
        monkeypatch.setattr("tiersave.format.manifest.READ_VERSIONS", known)
        with pytest.raises(UnsupportedFormatVersionError, match=r"format version 3\.0.*Upgrade tiersave"):
            Manifest.parse(data, path="m.json")
    monkeypatch.setattr("tiersave.format.manifest.READ_VERSIONS", READ_VERSIONS)
    assert Manifest.parse(data, path="m.json").shards[0].encoding is not None


@pytest.mark.s3
def test_s3_round_trip(src, s3_storage, tmp_path):
    result = copy_checkpoint(src, s3_storage, 5, compress="zstd", read_back=True)
    assert result.file_bytes < result.stored_bytes
    assert Catalog(s3_storage).verify(5).ok
    assert_same(restore(s3_storage), state(5))
    back = LocalStorage(tmp_path / "back")
    copy_checkpoint(s3_storage, back, 5)
    assert all(s.encoding is None for s in Catalog(back).manifest(5).shards)
    assert_same(restore(back), state(5))


def test_export_from_a_compressed_tier(src, tmp_path):
    from safetensors.torch import load_file

    from tiersave.export import export_safetensors

    dst, _, _ = _compressed(src, tmp_path)
    export_safetensors(Catalog(dst), 5, tmp_path / "out.safetensors")
    loaded = load_file(str(tmp_path / "out.safetensors"))
    want = state(5)
    for name in ("fp32", "bf16", "fp16", "int", "bool"):
        assert_same(loaded[name], want[name])


def test_auto_sends_the_first_drain_plain_then_compresses_only_where_it_pays(src, tmp_path, caplog):
    import functools
    import logging

    from tiersave.autocompress import AutoCompress, codec_calibration

    auto = AutoCompress("slow", threads=2)
    results = []
    for i, slow in enumerate((None, 1e3, 1e13)):  # first unmeasured; then a 1 kB/s tier; then a 10 TB/s one
        if slow is not None:
            auto.write_bps = slow
        dst = LocalStorage(tmp_path / f"t{i}")
        with caplog.at_level(logging.INFO, logger="tiersave.autocompress"):
            results.append(auto.drain(functools.partial(copy_checkpoint, src, dst, 5)))
        encoded = [s.encoding is not None for s in Catalog(dst).manifest(5).shards]
        assert all(encoded) if slow == 1e3 else not any(encoded)
        assert_same(restore(dst), state(5))
    assert "sending plain to measure it" in caplog.text
    assert "compressing is faster end to end" in caplog.text and "would not be faster" in caplog.text
    assert results[1].file_bytes < results[1].stored_bytes
    assert codec_calibration().bytes_per_s > 0 and codec_calibration().ratio > 1


def test_codec_calibration_is_cached(tmp_path, monkeypatch):
    from tiersave import autocompress

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(autocompress, "_calibration", None)
    first = autocompress.codec_calibration()
    cache = tmp_path / "tiersave" / "codec-calibration.json"
    doc = json.loads(cache.read_text())
    (entry,) = doc.values()
    assert entry["bytes_per_s"] == first.bytes_per_s
    entry["bytes_per_s"] = 123.0  # the next process reads the cache instead of measuring
    cache.write_text(json.dumps(doc))
    monkeypatch.setattr(autocompress, "_calibration", None)
    assert autocompress.codec_calibration().bytes_per_s == 123.0
    for damaged in ("NaN", "1e999", "-5.0", "0.0"):  # measured again, never used
        cache.write_text(json.dumps(doc).replace("123.0", damaged))
        monkeypatch.setattr(autocompress, "_calibration", None)
        again = autocompress.codec_calibration().bytes_per_s
        assert again != 123.0 and 0 < again < float("inf"), damaged
    monkeypatch.setattr(autocompress, "_calibration", None)


def test_auto_tier_in_a_chain(tmp_path):
    slow = chain_saves(tmp_path, "auto", [1, 2])
    assert all(s.encoding is None for s in Catalog(slow).manifest(1).shards)  # the measuring drain
    assert_same(restore(slow, 2), state(2))  # plain or compressed, as measured: restorable either way


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda e: e.update(codec="lz4"), "codec 'lz4' is not supported"),
        (lambda e: e.update(extra=1), "exactly the fields codec and frames"),
        (lambda e: e.update(frames=[]), "non-empty array"),
        (lambda e: e["frames"][0].__setitem__(2, "xyz"), r"must be \[raw_bytes, stored_bytes, crc32c_hex, planes\]"),
        (lambda e: e["frames"][0].__setitem__(3, 3), "planes 3 is not one of"),
        (lambda e: e["frames"][0].__setitem__(1, e["frames"][0][0] + 1), "stores .* bytes, outside"),
        (lambda e: e["frames"][0].__setitem__(0, True), "must be \\[raw_bytes"),
        (lambda e: e["frames"].pop(), "frames decode to .* the shard has"),
    ],
)
def test_malformed_encoding_is_a_format_error(src, tmp_path, edit, message):
    dst, _, _ = _compressed(src, tmp_path)
    path = _edit_manifest(dst, lambda doc: edit(doc["shards"][0]["encoding"]))
    with pytest.raises(FormatError, match=message):
        Manifest.parse(path.read_bytes(), path=str(path))


def test_any_decoded_range_reads_back_exactly(src, tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    dst, m, _ = _compressed(src, tmp_path)
    plain = (src.root / step_dirname(5) / Catalog(src).manifest(5).shards[0].file).read_bytes()
    size = m.shards[0].size
    with Catalog(dst).open(5) as ckpt:
        reader = ckpt.reader(0)
        assert reader.size == size

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.integers(0, size - 1), st.integers(1, 3 << 20))
        def check(offset, length):
            length = min(length, size - offset)
            out = bytearray(length)
            reader.read_into(offset, memoryview(out))
            assert out == plain[offset : offset + length]

        check()
        with pytest.raises(CorruptCheckpointError, match="past the decoded end"):
            reader.read_into(size - 10, memoryview(bytearray(20)))


def test_restore_falls_back_to_the_compressed_tier(tmp_path):
    import shutil

    chain_saves(tmp_path, "zstd", [3])
    shutil.rmtree(tmp_path / "fast" / step_dirname(3))  # the fast tier lost it (a node replaced)
    tiers = [tiersave.Tier(tmp_path / "fast", name="fast"), tiersave.Tier(tmp_path / "slow", name="slow")]
    with tiersave.Checkpointer(tiers=tiers) as ckpt:
        assert_same(ckpt.restore(), state(3))
