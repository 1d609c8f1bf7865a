"""``tiersave copy SRC DST``: between a directory, mem:// and a real S3 server (SeaweedFS), verified."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.cli import main
from tiersave.format.layout import step_dirname
from tiersave.storage import open_storage
from tiersave.storage.memory import MemoryStorage
from tiersave.testing.seaweed import SeaweedServer


@pytest.fixture(scope="module")
def seaweed():
    return SeaweedServer.shared()


@pytest.fixture
def s3_uri(seaweed, monkeypatch):
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    bucket = f"cli-{uuid.uuid4().hex[:16]}"
    seaweed.storage(bucket)  # creates the bucket
    return f"s3://{bucket}/runs/a?endpoint={seaweed.endpoint}&part_size=5MiB&retries=2"


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    with tiersave.Checkpointer(root, chunk_bytes=1 << 20) as ckpt:
        for step in (1, 2, 3):
            state = {"w": torch.full((1000, 700), float(step)), "b": torch.arange(step + 3), "step": step}
            ckpt.save(step, state, metrics={"loss": 1 / step}).result()
    return root


def run_json(capsys, *argv):
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


@pytest.mark.s3
def test_copy_local_to_s3_and_back(capsys, src, s3_uri, tmp_path):
    code, doc, _ = run_json(capsys, "copy", str(src), s3_uri)
    assert code == 0 and doc["ok"]
    assert [c["step"] for c in doc["copied"]] == [3] and doc["copied"][0]["read_back"]
    code, doc, _ = run_json(capsys, "copy", str(src), s3_uri, "--all")
    assert code == 0 and [(c["step"], c["skipped"]) for c in doc["copied"]] == [(1, False), (2, False), (3, True)]
    code, doc, _ = run_json(capsys, "ls", s3_uri)
    assert code == 0 and [c["step"] for c in doc["checkpoints"]] == [1, 2, 3]
    back = tmp_path / "back"
    code, doc, _ = run_json(capsys, "copy", s3_uri, f"file://{back}", "--step", "2", "--no-verify")
    assert code == 0 and not doc["copied"][0]["read_back"]
    with tiersave.Checkpointer(back) as ckpt:
        restored = ckpt.restore()
    assert restored["step"] == 2 and torch.equal(restored["w"], torch.full((1000, 700), 2.0))
    assert code == 0 and main(["verify", str(back), "--all"]) == 0


def test_copy_to_memory_tier_text_output(capsys, src):
    name = f"cli-{uuid.uuid4().hex[:10]}"
    try:
        assert main(["copy", str(src), f"mem://{name}", "--all", "--threads", "2", "--buffer", "4MiB"]) == 0
        out = capsys.readouterr().out
        assert "copied, verified" in out and f"mem://{name}" in out
        assert Catalog(MemoryStorage(name)).steps() == [1, 2, 3]
        assert main(["copy", str(src), f"mem://{name}"]) == 0
        assert "skipped (identical)" in capsys.readouterr().out
    finally:
        MemoryStorage(name).destroy()


def test_corrupt_source_exit_1_and_nothing_committed(capsys, src, tmp_path):
    storage = open_storage(src)
    shard = Catalog(storage).manifest(3).shards[0].file
    path = src / step_dirname(3) / shard
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    dst = tmp_path / "dst"
    code, doc, err = run_json(capsys, "copy", str(src), str(dst), "--all")
    assert code == 1 and not doc["ok"]
    assert [c["step"] for c in doc["copied"]] == [1, 2]
    assert doc["failed"]["step"] == 3 and doc["failed"]["type"] == "CorruptCheckpointError"
    assert "checksum mismatch" in err
    assert Catalog(open_storage(dst)).steps() == [1, 2]
    assert sorted(p.name for p in dst.iterdir()) == [step_dirname(1), step_dirname(2)]


def test_usage_errors(capsys, src, tmp_path):
    assert main(["copy", str(src), str(tmp_path / "d"), "--step", "1", "--all"]) == 2
    assert main(["copy", str(src), "ftp://host/x"]) == 2
    assert "unsupported storage URI scheme" in capsys.readouterr().err
    assert main(["copy", str(tmp_path / "missing"), str(tmp_path / "d")]) == 1
    assert main(["copy", str(src), str(tmp_path / "d"), "--step", "99"]) == 1
    assert main(["copy", str(src), "s3://bucket?nonsense=1"]) == 2


def test_copy_command_imports_without_torch():
    code = (
        "import sys; from tiersave.cli import main; "
        "rc = main(['copy', '--help']); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "tiersave copy" in proc.stdout


@pytest.mark.s3
def test_copy_compressed_to_s3_and_inspect_shows_the_ratio(src, s3_uri, tmp_path, capsys):
    code, doc, _ = run_json(capsys, "copy", str(src), s3_uri, "--step", "2", "--compress", "zstd")
    assert code == 0 and doc["ok"]
    copied = doc["copied"][0]
    assert copied["file_bytes"] < copied["stored_bytes"] / 10  # torch.full compresses to almost nothing
    code, info, _ = run_json(capsys, "inspect", s3_uri, "--step", "2")
    assert code == 0 and info["format_version"] == "3.0"
    assert info["file_bytes"] == copied["file_bytes"] and info["compression_ratio"] > 10
    assert main(["inspect", s3_uri, "--step", "2"]) == 0
    assert "compressed (zstd):" in capsys.readouterr().out
    assert main(["verify", s3_uri, "--step", "2"]) == 0
    capsys.readouterr()
    back = tmp_path / "back"
    code, doc, _ = run_json(capsys, "copy", s3_uri, str(back), "--step", "2")
    assert code == 0 and doc["copied"][0]["file_bytes"] == doc["copied"][0]["stored_bytes"]
    with tiersave.Checkpointer(back) as ckpt:
        assert torch.equal(ckpt.restore(2)["w"], torch.full((1000, 700), 2.0))
