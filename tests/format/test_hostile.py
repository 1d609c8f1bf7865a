"""Hostile and corrupt checkpoints: each is a clean TiersaveError, no code runs, nothing outside the root
is touched, memory stays bounded. Messages are pinned where a user reads them (safetensors style)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiersave
from tiersave.format.manifest import Manifest, seal

STEP_DIR = "step-0000000001"


@pytest.fixture
def saved(root: Path) -> Path:
    """A real checkpoint of step 1 with two tensors and some tree structure."""
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"a": torch.arange(3000, dtype=torch.float32), "b": torch.ones(5, 3, dtype=torch.int64), "n": 7})
    return root


def manifest_path(root: Path) -> Path:
    return root / STEP_DIR / "manifest.json"


def load_doc(root: Path) -> dict:
    return json.loads(manifest_path(root).read_bytes())


def write_doc(root: Path, doc: dict) -> None:
    """Write an edited manifest with a matching checksum, as a forger would: what is left to catch it is the
    structural validation these tests pin."""
    manifest_path(root).write_bytes(seal(doc))


def restore_error(root: Path, exc_type=tiersave.FormatError) -> str:
    with tiersave.Checkpointer(root) as ckpt, pytest.raises(exc_type) as info:
        ckpt.restore(1)
    assert isinstance(info.value, tiersave.TiersaveError)
    return str(info.value)


def edit(root: Path, fn) -> None:
    doc = load_doc(root)
    fn(doc)
    write_doc(root, doc)


# -- shard damage -------------------------------------------------------------------------------------


def test_truncated_shard(saved):
    shard = saved / STEP_DIR / "shard-00000-000.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    msg = restore_error(saved, tiersave.CorruptCheckpointError)
    assert "step 1: shard shard-00000-000.bin is 16383 bytes, the manifest says 16384" in msg


def test_appended_bytes(saved):
    shard = saved / STEP_DIR / "shard-00000-000.bin"
    with shard.open("ab") as f:
        f.write(b"\0")
    assert "16385 bytes, the manifest says 16384" in restore_error(saved, tiersave.CorruptCheckpointError)


@pytest.mark.parametrize("offset", [0, 5000, 12288 + 7])
def test_flipped_bit_is_detected_and_names_the_tensor(saved, offset):
    shard = saved / STEP_DIR / "shard-00000-000.bin"
    data = bytearray(shard.read_bytes())
    data[offset] ^= 0x10
    shard.write_bytes(bytes(data))
    msg = restore_error(saved, tiersave.CorruptCheckpointError)
    tensor = "a" if offset < 12000 else "b"
    assert f"checksum mismatch in step 1, file shard-00000-000.bin, tensor {tensor!r}, chunk 0" in msg


def test_missing_shard(saved):
    (saved / STEP_DIR / "shard-00000-000.bin").unlink()
    assert "shard shard-00000-000.bin is missing" in restore_error(saved, tiersave.CorruptCheckpointError)


def test_shard_swapped_from_another_checkpoint(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"a": torch.zeros(100)})
        ckpt.save(2, {"a": torch.ones(100)})
    os.replace(root / "step-0000000002" / "shard-00000-000.bin", root / STEP_DIR / "shard-00000-000.bin")
    assert "checksum mismatch in step 1" in restore_error(root, tiersave.CorruptCheckpointError)


def test_nonzero_padding_is_reported_by_verify(saved):
    shard = saved / STEP_DIR / "shard-00000-000.bin"
    data = bytearray(shard.read_bytes())
    data[12100] = 1  # after tensor 'a' (12000 bytes), before the 4 KiB boundary
    shard.write_bytes(bytes(data))
    with tiersave.Checkpointer(saved) as ckpt:
        report = ckpt.verify(1)
        assert not report.ok and "non-zero padding at byte 12000" in report.errors[0]
        ckpt.restore(1)  # restore reads only tensor bytes, which are intact


def test_symlinked_shard_is_refused(saved, tmp_path):
    outside = tmp_path / "outside.bin"
    shard = saved / STEP_DIR / "shard-00000-000.bin"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    assert "is a symbolic link; tiersave never follows links" in restore_error(saved)


# -- manifest damage ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: d["tensors"]["b"].update(offset=8192), "tensors 'a' and 'b' overlap in their shard"),
        (lambda d: d["tensors"]["b"].update(offset=1 << 40), "exceeds shard shard-00000-000.bin of 16384 bytes"),
        (lambda d: d["tensors"]["b"].update(offset=12289), "offset 12289 is not 4096-aligned"),
        (lambda d: d["tensors"]["b"].update(offset=-4096), "offset = -4096 is out of range"),
        (lambda d: d["tensors"]["b"].update(nbytes=121), "nbytes 121 != 120 implied by shape [5, 3] and int64"),
        (lambda d: d["tensors"]["b"].update(shape=[2**62, 2**62]), "implied by shape"),
        (lambda d: d["tensors"]["b"].update(dtype="float128"), "has unknown dtype 'float128'"),
        (lambda d: d["tensors"]["b"].update(dtype="object"), "has unknown dtype 'object'"),
        (lambda d: d["tensors"]["b"].update(crc32c=[]), "has 0 checksums for 1 chunks"),
        (lambda d: d["tensors"]["b"].update(crc32c=["xyz"]), "crc32c must be an array of 8-hex-digit strings"),
        (lambda d: d["tensors"]["b"].update(crc32c=["00000000\n"]), "crc32c must be an array of 8-hex-digit strings"),
        (lambda d: d["tensors"]["b"].update(shard=3), "shard = 3 is out of range"),
        (lambda d: d["tensors"]["b"].update(extra=1), "has unknown field(s) extra"),
        (lambda d: d["shards"][0].update(file="../../etc/passwd"), "is not a safe relative name"),
        (lambda d: d["shards"][0].update(file="/etc/passwd"), "is not a safe relative name"),
        (lambda d: d["shards"][0].update(file="a/../b.bin"), "is not a safe relative name"),
        (lambda d: d["shards"][0].update(file="x\u0000.bin"), "is not a safe relative name"),
        (lambda d: d["shards"][0].update(size=16385), "size 16385 is not a multiple of 4096"),
        (lambda d: d["shards"][0].update(rank=1), "rank = 1 is out of range [0, 0]"),
        (lambda d: d["shards"].append(dict(d["shards"][0])), "two shards name the same file"),
        (lambda d: d.update(step=2), "manifest says step 2 but was found as step 1"),
        (lambda d: d.update(format="safetensors"), "not a tiersave manifest"),
        (lambda d: d.update(format_version="1"), "is not MAJOR.MINOR"),
        (lambda d: d.update(surprise=True), "manifest has unknown field(s) surprise"),
        (lambda d: d.pop("tree"), "manifest lacks field(s) tree"),
        (lambda d: d["checksum"].update(algorithm="md5"), "checksum algorithm 'md5' is not supported"),
        (lambda d: d.update(tree={"x": {"$tensor": "nope"}}), "references unknown tensor 'nope'"),
        (lambda d: d.update(tree={"a": {"$tensor": "a"}}), "the tree never uses: b"),
        (lambda d: d.update(tree={"$pickle": "gASV"}), "unknown tag '$pickle'"),
        (lambda d: d.update(tree={"$stateful": {"type": "os.system", "state": 1, "x": 2}}), "$stateful needs exactly"),
        (lambda d: d.update(metrics={"loss": "high"}), "metrics must map names to finite numbers"),
        (lambda d: d.update(tags=["a b"]), "tags must be an array of names"),
    ],
)
def test_invalid_manifests_are_rejected(saved, mutate, fragment):
    edit(saved, mutate)
    msg = restore_error(saved)
    assert fragment in msg
    assert str(manifest_path(saved)) in msg or "step" in msg


def test_tensor_name_with_path_traversal_is_just_a_label(root):
    # Names are data: a tensor called "../../x" is stored in the shard like any other and never becomes a path.
    state = {"../../x": torch.ones(3), "/abs": torch.zeros(2)}
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state)
        restored = ckpt.restore(1)
    assert set(restored) == {"../../x", "/abs"}
    assert sorted(p.name for p in (root / STEP_DIR).iterdir()) == ["manifest.json", "shard-00000-000.bin"]


def test_unknown_major_version_is_a_clear_error(saved):
    edit(saved, lambda d: d.update(format_version="6.0"))
    msg = restore_error(saved, tiersave.UnsupportedFormatVersionError)
    assert "written with format version 6.0; this tiersave" in msg
    assert "reads 1.x, 2.x, 3.x, 4.x and 5.x only. Upgrade tiersave" in msg


def test_a_1x_reader_refuses_format_2_cleanly(saved, monkeypatch):
    # What a reader of 1.x (tiersave before format 2.0) says about a checkpoint with shard references.
    monkeypatch.setattr("tiersave.format.manifest.READ_VERSIONS", {1: 1})
    edit(saved, lambda d: d.update(format_version="2.0"))
    msg = restore_error(saved, tiersave.UnsupportedFormatVersionError)
    assert "written with format version 2.0; this tiersave" in msg and "reads 1.x only. Upgrade tiersave" in msg


def test_newer_minor_version_fields_are_ignored_older_are_not(saved):
    edit(saved, lambda d: d.update(format_version="1.7", added_in_1_7={"x": 1}))
    with tiersave.Checkpointer(saved) as ckpt:
        assert ckpt.restore(1)["n"] == 7
    edit(saved, lambda d: d.update(format_version="1.0"))
    assert "unknown field(s) added_in_1_7" in restore_error(saved)


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b'{"a": NaN}', "NaN is not allowed"),
        (b'{"a": Infinity}', "Infinity is not allowed"),
        (b'{"a": -1.5e999}', "number -1.5e999 is out of range"),
        (b"\xff\xfe{}", "is not valid UTF-8"),
        (b'{"a": [', "is not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"x":' * 600 + b"1" + b"}" * 600, "nested deeper than 512 levels"),
        (b"9" * 5000, "is not valid JSON"),
        (pickle.dumps({"a": 1}), "is not valid"),
        (b"[]", "manifest must be a JSON object"),
    ],
    ids=[
        "dup",
        "nan",
        "inf",
        "overflow",
        "utf8",
        "truncated",
        "deep-array",
        "deep-object",
        "huge-int",
        "pickle",
        "array",
    ],
)
def test_malformed_json(saved, raw, fragment):
    manifest_path(saved).write_bytes(raw)
    assert fragment in restore_error(saved)


def test_a_damaged_exponent_is_a_format_error_not_a_crash(root):
    """One flipped byte turns a metric of 1.5e+300 into 1.5e+900, which Python's JSON reads as infinite; the
    seal check then could not serialize the document again (a ValueError escaped, found by the long fuzz run)."""
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"n": 7}, metrics={"loss": 1.5e300})
    raw = manifest_path(root).read_bytes()
    assert raw.count(b"1.5e+300") == 1
    manifest_path(root).write_bytes(raw.replace(b"1.5e+300", b"1.5e+900"))
    assert "number 1.5e+900 is out of range" in restore_error(root)


def test_huge_manifest_is_refused_before_reading(saved):
    path = manifest_path(saved)
    with path.open("r+b") as f:
        f.truncate(65 << 20)  # sparse: costs no disk, but would cost 65 MiB of RAM if read
    assert "over the 67108864-byte limit" in restore_error(saved)


def test_pickle_payload_never_executes(saved, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = pickle.dumps(Evil())
    manifest_path(saved).write_bytes(payload)
    (saved / STEP_DIR / "shard-00000-000.bin").write_bytes(payload.ljust(16384, b"\0"))
    restore_error(saved)
    with tiersave.Checkpointer(saved) as ckpt:
        assert not ckpt.verify(1).ok
    assert not marker.exists()


def test_restore_runs_no_subprocess_and_imports_nothing_new(saved):
    """An audit hook in a fresh process records exec/system/import events while a checkpoint is restored."""
    code = f"""
import sys, tiersave, torch, numpy
events = []
tiersave.Checkpointer({str(saved)!r}).restore(1)  # warm: imports done
def hook(event, args):
    if event in ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "exec", "import", "pickle.find_class"):
        events.append((event, str(args)[:80]))
sys.addaudithook(hook)
tiersave.Checkpointer({str(saved)!r}).restore(1)
print(events)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_manifest_roundtrip_is_exact(saved):
    data = manifest_path(saved).read_bytes()
    m = Manifest.parse(data, path="m")
    assert Manifest.parse(m.to_json(), path="m") == m
