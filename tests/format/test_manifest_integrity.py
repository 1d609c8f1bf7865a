"""The manifest's own checksum (format 1.1) and the state tree's depth cap.

Every byte of a checkpoint is verified: tensor bytes by their CRC-32C, the manifest (scalars, strings, dtypes,
tensor references, data positions) by ``checksum.manifest_sha256``. Nesting at any depth gives a typed error,
never RecursionError.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tiersave
from helpers import accepted_bit_flips
from tiersave.format.manifest import MANIFEST_HASH_FIELD, Manifest, seal
from tiersave.format.tree import MAX_TREE_DEPTH

STEP_DIR = "step-0000000001"


@pytest.fixture
def saved(root: Path) -> Path:
    state = {
        "w": torch.arange(8, dtype=torch.float32),
        "v": torch.arange(8, dtype=torch.int32),
        "data": {"position": 3, "name": "shard-a", "shuffle": True, "blob": b"xyz"},
        "lr": 0.001,
    }
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state)
    return root


def manifest_path(root: Path) -> Path:
    return root / STEP_DIR / "manifest.json"


def unsealed_edit(root: Path, fn) -> None:
    """Change the manifest without updating its checksum: damage, or a careless hand edit."""
    doc = json.loads(manifest_path(root).read_bytes())
    fn(doc)
    manifest_path(root).write_bytes(json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode())


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda d: d["tree"]["data"].update(position=7), id="data-position"),
        pytest.param(lambda d: d["tree"].update(lr=0.01), id="learning-rate"),
        pytest.param(lambda d: d["tree"]["data"].update(name="shard-b"), id="string"),
        pytest.param(lambda d: d["tree"]["data"].update(shuffle=False), id="bool"),
        pytest.param(lambda d: d["tree"]["data"].update(blob={"$bytes": "eHl6eg=="}), id="bytes"),
        pytest.param(lambda d: d["tensors"]["w"].update(dtype="int32"), id="dtype-same-size"),
        pytest.param(lambda d: d["tree"].update(w=d["tree"]["v"], v=d["tree"]["w"]), id="swapped-tensor-references"),
    ],
)
def test_an_unsealed_edit_is_detected_by_restore_and_verify(saved, mutate):
    unsealed_edit(saved, mutate)
    with tiersave.Checkpointer(saved) as ckpt:
        with pytest.raises(tiersave.CorruptCheckpointError, match="does not match its checksum"):
            ckpt.restore(1)
        report = ckpt.verify(1)
    assert not report.ok
    assert "does not match its checksum" in report.errors[0]


def test_every_single_bit_flip_of_a_manifest_is_rejected(saved):
    data = manifest_path(saved).read_bytes()
    assert len(data) > 500
    assert accepted_bit_flips(data) == []


def test_a_format_1_0_manifest_still_reads_and_is_marked_unverified(saved):
    def downgrade(d):
        d["format_version"] = "1.0"
        d["checksum"].pop(MANIFEST_HASH_FIELD)

    unsealed_edit(saved, downgrade)
    parsed = Manifest.parse(manifest_path(saved).read_bytes(), path="m")
    assert parsed.manifest_verified is False
    with tiersave.Checkpointer(saved) as ckpt:
        assert ckpt.restore(1)["data"]["position"] == 3
        report = ckpt.verify(1)
    assert report.ok
    assert any("not covered by a checksum" in note for note in report.notes)


def test_a_1_1_manifest_without_its_checksum_is_refused(saved):
    unsealed_edit(saved, lambda d: d["checksum"].pop(MANIFEST_HASH_FIELD))
    with tiersave.Checkpointer(saved) as ckpt, pytest.raises(tiersave.FormatError, match="lacks checksum"):
        ckpt.restore(1)


def test_a_malformed_checksum_field_is_refused(saved):
    unsealed_edit(saved, lambda d: d["checksum"].update({MANIFEST_HASH_FIELD: "zz"}))
    with pytest.raises(tiersave.FormatError, match="64 lowercase hex digits"):
        Manifest.parse(manifest_path(saved).read_bytes(), path="m")


def test_a_new_manifest_is_sealed_and_verified(saved):
    doc = json.loads(manifest_path(saved).read_bytes())
    assert doc["format_version"] == "1.1"
    assert len(doc["checksum"][MANIFEST_HASH_FIELD]) == 64
    assert Manifest.parse(manifest_path(saved).read_bytes(), path="m").manifest_verified
    assert seal(doc) == manifest_path(saved).read_bytes()  # sealing is a pure function of the document


# -- depth caps -------------------------------------------------------------------------------------------


def _nested(depth: int, kind: str):
    value = {"t": torch.ones(2)}
    for _ in range(depth):
        value = [value] if kind == "list" else ((value,) if kind == "tuple" else {"k": value})
    return value


@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
def test_a_state_at_the_cap_minus_one_round_trips(root, kind):
    state = _nested(MAX_TREE_DEPTH - 1, kind)
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state)
        restored = ckpt.restore(1)
        assert ckpt.verify(1).ok
    node = restored
    for _ in range(MAX_TREE_DEPTH - 1):
        node = node[0] if kind in ("list", "tuple") else node["k"]
    assert torch.equal(node["t"], torch.ones(2))


@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
def test_a_state_past_the_cap_is_refused_at_save_with_a_typed_error(root, kind):
    with tiersave.Checkpointer(root) as ckpt:
        with pytest.raises(tiersave.UnsupportedStateError, match=f"nests deeper than {MAX_TREE_DEPTH} levels"):
            ckpt.save(1, _nested(MAX_TREE_DEPTH + 1, kind))
        assert ckpt.list() == []


@pytest.mark.parametrize("depth", [MAX_TREE_DEPTH + 1, 400, 505])
def test_a_forged_deep_tree_is_a_format_error_not_a_recursion_error(saved, depth):
    doc = json.loads(manifest_path(saved).read_bytes())
    doc["tree"]["deep"] = json.loads("[" * depth + "]" * depth)
    manifest_path(saved).write_bytes(seal(doc))
    with tiersave.Checkpointer(saved) as ckpt:
        with pytest.raises(tiersave.FormatError, match="nested"):
            ckpt.restore(1)
        assert not ckpt.verify(1).ok
