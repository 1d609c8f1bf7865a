"""Format 1.2 (content hashes) and 2.0 (shard references), docs/format.md section 9: what a reader accepts
and the pinned messages of what it refuses. The checkpoints here hash with SHA-256 (the versions without
``checksum.content``); tests/format/test_content_hash.py covers BLAKE3's 1.3, 2.1 and 3.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tiersave
from tiersave import knobs
from tiersave.format.manifest import Manifest, ShardInfo, seal, version_for

H = "ab" * 32


@pytest.fixture
def chain(root: Path) -> Path:
    """Steps 1 (full, 1.2) and 2 (2.0, its base-weight shard a reference to step 1's)."""
    state = {"w": torch.randn(3 << 20), "a": torch.zeros(10)}
    with knobs.override_content_hash("sha256"), tiersave.Checkpointer(root, incremental=True) as ckpt:
        ckpt.save(1, state)
        state["a"] += 1
        ckpt.save(2, state)
    return root


def doc_of(root: Path, step: int) -> dict:
    return json.loads((root / f"step-{step:010d}" / "manifest.json").read_bytes())


def parse(doc: dict, step: int = 2) -> Manifest:
    return Manifest.parse(seal(doc), path="m.json", expect_step=step)


def test_the_chain_is_as_specified(chain):
    one, two = doc_of(chain, 1), doc_of(chain, 2)
    assert one["format_version"] == "1.2" and two["format_version"] == "2.0"
    ref = next(s for s in two["shards"] if "step" in s)
    held = next(s for s in one["shards"] if s["file"] == ref["file"])
    assert ref["step"] == 1 and ref["content"] == held["content"] and ref["size"] == held["size"]
    assert sum(n for n, _ in ref["content"]) == ref["size"]
    assert all(len(h) == 64 for _, h in ref["content"])


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda s: s.update(step=2), "shards[0].step = 2 is out of range [0, 1]"),
        (lambda s: s.update(step=-1), "shards[0].step = -1 is out of range"),
        (lambda s: s.pop("content"), "shards[0] is a reference to step 1 without content hashes"),
        (lambda s: s["content"].append([4096, H]), "covers"),
        (lambda s: s["content"][0].__setitem__(0, 100), "shards[0].content piece length = 100 is out of range"),
        (lambda s: s["content"][0].__setitem__(1, "xyz"), "64-hex-digit hash"),
    ],
)
def test_malformed_references_are_refused(chain, edit, fragment):
    doc = doc_of(chain, 2)
    index = next(i for i, s in enumerate(doc["shards"]) if "step" in s)
    edit(doc["shards"][index])
    with pytest.raises(tiersave.FormatError) as info:
        parse(doc)
    assert fragment.replace("shards[0]", f"shards[{index}]") in str(info.value)


def test_a_reference_in_a_1x_manifest_is_an_unknown_field(chain):
    doc = doc_of(chain, 2)
    doc["format_version"] = "1.2"
    with pytest.raises(tiersave.FormatError, match=r"has unknown field\(s\) step"):
        parse(doc)


def test_content_in_a_1_1_manifest_is_an_unknown_field(chain):
    doc = doc_of(chain, 1)
    doc["format_version"] = "1.1"
    with pytest.raises(tiersave.FormatError, match=r"has unknown field\(s\) content"):
        parse(doc, step=1)


def test_version_follows_what_the_shards_use():
    plain = (ShardInfo("a", 0, 4096),)
    hashed = (ShardInfo("a", 0, 4096, ((4096, H),)),)
    ref = (ShardInfo("a", 0, 4096, ((4096, H),), step=3),)
    assert version_for(plain) == "1.1" and version_for(plain, "1.0") == "1.0"
    assert version_for(hashed) == "1.2" and version_for(ref) == "2.0"
    assert version_for(plain, "2.0") == "1.1"  # a copy that resolved every reference is a plain checkpoint
