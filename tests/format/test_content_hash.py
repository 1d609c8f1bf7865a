"""The hash function of content pieces (docs/format.md section 9): BLAKE3 named in ``checksum.content`` with
the next minor version (1.3, 2.1, 3.1), SHA-256 without the field as before, and a save whose base was hashed
by another function than this process's written in full."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tiersave
from tiersave import knobs
from tiersave.catalog import Catalog
from tiersave.engine import increment
from tiersave.format.manifest import Manifest, ShardInfo, seal, version_for
from tiersave.storage import open_storage

H = "cd" * 32


def state() -> dict:
    return {"w": torch.randn(3 << 20), "a": torch.zeros(10)}


def doc_of(root: Path, step: int) -> dict:
    return json.loads((root / f"step-{step:010d}" / "manifest.json").read_bytes())


def write_doc(root: Path, step: int, doc: dict) -> None:
    (root / f"step-{step:010d}" / "manifest.json").write_bytes(seal(doc))


def manifest(root: Path, step: int) -> Manifest:
    return Catalog(open_storage(str(root))).manifest(step)


def test_blake3_pieces_are_named_and_match_the_bytes(root):
    blake3 = pytest.importorskip("blake3")
    s = state()
    with knobs.override_content_hash("blake3"), tiersave.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(1, s)
        s["a"] += 1
        ckpt.save(2, s)
        restored = ckpt.restore(2)
    assert torch.equal(restored["w"], s["w"]) and torch.equal(restored["a"], s["a"])
    one, two = doc_of(root, 1), doc_of(root, 2)
    assert (one["format_version"], two["format_version"]) == ("1.3", "2.1")
    assert one["checksum"]["content"] == two["checksum"]["content"] == "blake3"
    ref = next(sh for sh in two["shards"] if "step" in sh)
    n, digest = ref["content"][0]
    data = (root / "step-0000000001" / ref["file"]).read_bytes()[:n]
    assert digest == blake3.blake3(data).hexdigest()
    assert manifest(root, 2).content_hash == "blake3"


def test_sha256_manifests_stay_as_they_were(root):
    with knobs.override_content_hash("sha256"), tiersave.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(1, state())
    doc = doc_of(root, 1)
    assert doc["format_version"] == "1.2" and "content" not in doc["checksum"]
    assert manifest(root, 1).content_hash == "sha256"


def test_version_names_the_hash_one_minor_up():
    plain = (ShardInfo("a", 0, 4096),)
    hashed = (ShardInfo("a", 0, 4096, ((4096, H),)),)
    ref = (ShardInfo("a", 0, 4096, ((4096, H),), step=3),)
    assert version_for(hashed, content_hash="blake3") == "1.3"
    assert version_for(ref, content_hash="blake3") == "2.1"
    assert version_for(plain, content_hash="blake3") == "1.1"  # nothing hashed: nothing to name
    m = Manifest(step=4, shards=hashed, tensors={}, tree={}, content_hash="blake3")
    parsed = Manifest.parse(m.to_json(), path="m.json")
    assert parsed.format_version == "1.3" and parsed.content_hash == "blake3"


def test_a_named_hash_in_an_older_minor_is_an_unknown_field():
    m = Manifest(step=4, shards=(ShardInfo("a", 0, 4096, ((4096, H),), step=3),), tensors={}, tree={})
    doc = json.loads(m.to_json())
    doc["checksum"]["content"] = "blake3"
    assert doc["format_version"] == "2.0"
    with pytest.raises(tiersave.FormatError, match=r"checksum has unknown field\(s\) content"):
        Manifest.parse(seal(doc), path="m.json")


def test_an_unknown_hash_is_refused_by_name():
    m = Manifest(step=4, shards=(ShardInfo("a", 0, 4096, ((4096, H),)),), tensors={}, tree={}, content_hash="blake3")
    doc = json.loads(m.to_json())
    doc["checksum"]["content"] = "md5"
    with pytest.raises(tiersave.FormatError, match=r"checksum.content 'md5' is not a content hash .*sha256, blake3"):
        Manifest.parse(seal(doc), path="m.json")


def test_a_base_hashed_otherwise_gives_one_full_save_then_references_again(root):
    s = state()
    with knobs.override_content_hash("sha256"):
        with tiersave.Checkpointer(root, incremental=True) as ckpt:
            ckpt.save(1, s)
            s["a"] += 1
            ckpt.save(2, s)
        assert manifest(root, 2).referenced_bytes > 0
        # step 2 now claims another hash function: none of its digests can be compared with SHA-256's
        doc = doc_of(root, 2)
        doc["checksum"]["content"], doc["format_version"] = "blake3", "2.1"
        write_doc(root, 2, doc)
        with tiersave.Checkpointer(root, incremental=True) as ckpt:
            s["a"] += 1
            ckpt.save(3, s)
            s["a"] += 1
            ckpt.save(4, s)
            restored = ckpt.restore(3)
    three, four = manifest(root, 3), manifest(root, 4)
    assert three.referenced_bytes == 0 and three.stats["incremental_chain"] == 0
    assert four.referenced_steps == {3} and four.referenced_bytes > 0
    assert torch.equal(restored["w"], s["w"])


def test_blake3_asked_for_but_missing_is_a_clear_error(root, monkeypatch):
    monkeypatch.setattr(increment, "_blake3", lambda: None)
    with knobs.override_content_hash("auto"):
        assert increment.content_hash() == "sha256"  # auto: the fallback
    with (
        knobs.override_content_hash("blake3"),
        pytest.raises(tiersave.ConfigError, match=r"TIERSAVE_CONTENT_HASH=blake3 needs the blake3 package"),
    ):
        tiersave.Checkpointer(root, incremental=True)


def test_a_bad_knob_value_is_a_clear_error():
    with knobs.override_content_hash("md5"), pytest.raises(tiersave.ConfigError, match=r"TIERSAVE_CONTENT_HASH='md5'"):
        knobs.content_hash()
