"""The column-wise checks of a large tensor table and the seal shortcut accept exactly what the entry-by-entry
checks accept: a valid manifest parses to the same values, an invalid one fails with the same message."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from typing import Any

import pytest

from helpers import manifest_doc
from tiersave.errors import CorruptCheckpointError, FormatError
from tiersave.format import columns, sealing
from tiersave.format.manifest import MANIFEST_HASH_FIELD, Manifest, _Checker, seal

N = 300


def document(n: int = N) -> dict[str, Any]:
    tensors = {
        f"layer.{i}.w": {
            "dtype": ("bfloat16", "float32", "int8")[i % 3],
            "shape": [[4, 256], [512], [2048]][i % 3],
            "shard": i % 2,
            "offset": (i // 2) * 4096,
            "nbytes": 2048,
            "crc32c": [f"{i:08x}"],
        }
        for i in range(n)
    }
    tensors["empty"] = {"dtype": "float32", "shape": [0], "shard": 0, "offset": 0, "nbytes": 0, "crc32c": []}
    size = (n // 2 + 1) * 4096
    shards = [{"file": f"shard-{r}.bin", "rank": r, "size": size} for r in range(2)]
    return manifest_doc(tensors, {name: {"$tensor": name} for name in tensors}, shards, world_size=2)


def entry_by_entry(doc: dict[str, Any]) -> dict[str, Any]:
    checker = _Checker("m")
    return {name: checker.tensor(name, raw, len(doc["shards"]), 4096) for name, raw in doc["tensors"].items()}


def test_a_valid_table_gives_the_same_entries_either_way():
    doc = document()
    m = Manifest.parse(seal(doc), path="m")
    assert dict(m.tensors) == entry_by_entry(doc)
    assert list(m.tensors) == list(doc["tensors"])
    assert Manifest.parse(m.to_json(), path="m") == m


def tensor_edit(field: str, value: Any) -> Any:
    return lambda d: d["tensors"]["layer.151.w"].__setitem__(field, value)


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (tensor_edit("dtype", "float128"), "has unknown dtype 'float128'"),
        (tensor_edit("dtype", ["int8"]), "has unknown dtype ['int8']"),
        (tensor_edit("shape", [512, True]), "shape[1] must be an integer, got bool"),
        (tensor_edit("shape", [-1, -512]), "shape[0] = -1 is out of range"),
        (tensor_edit("shape", [1] * 65), "at most 64 dimensions"),
        (tensor_edit("shape", "512"), "shape must be an array"),
        (tensor_edit("shard", 2), "shard = 2 is out of range [0, 1]"),
        (tensor_edit("shard", 1.0), "shard must be an integer, got float"),
        (tensor_edit("offset", -4096), "offset = -4096 is out of range"),
        (tensor_edit("offset", 1 << 63), "is out of range"),
        (tensor_edit("offset", 4097), "offset 4097 is not 4096-aligned"),
        (tensor_edit("offset", 1 << 40), "exceeds shard"),
        (tensor_edit("offset", 0), "overlap in their shard"),
        (tensor_edit("nbytes", 4096), "nbytes 4096 != 2048"),
        (tensor_edit("nbytes", False), "nbytes must be an integer, got bool"),
        (tensor_edit("crc32c", []), "has 0 checksums for 1 chunks"),
        (tensor_edit("crc32c", ["0000000G"]), "8-hex-digit strings"),
        (tensor_edit("crc32c", [7]), "8-hex-digit strings"),
        (tensor_edit("crc32c", "00000000"), "8-hex-digit strings"),
        (tensor_edit("extra", 1), "has unknown field(s) extra"),
        (lambda d: d["tensors"]["layer.151.w"].pop("crc32c"), "lacks field(s) crc32c"),
        (lambda d: d["tensors"].__setitem__("layer.151.w", [1]), "must be an object"),
        (lambda d: d["tensors"].__setitem__("bad\0name", d["tensors"].pop("layer.151.w")), "contains NUL"),
        (lambda d: d["tensors"].__setitem__("x" * 1025, d["tensors"].pop("layer.151.w")), "too long"),
    ],
)
def test_one_bad_entry_among_many_is_named(mutate, fragment):
    doc = document()
    mutate(doc)
    range_fault = any(k in fragment for k in ("exceeds shard", "overlap", "aligned"))
    checker = _Checker("m")
    # Each fault is caught by the column checks (None: the table goes entry by entry) or, for a range, by
    # the range check (ranges_ok, then the entry-by-entry range checks).
    assert (checker.tensors_columns(doc["tensors"], 2, 4096) is None) != range_fault
    with pytest.raises(FormatError) as info:
        Manifest.parse(seal(doc), path="m")
    assert fragment in str(info.value)
    assert "layer.151.w" in str(info.value) or "name" in fragment or "NUL" in fragment or "too long" in fragment


def test_ranges_are_checked_across_shards_and_out_of_order():
    assert columns.ranges_ok([8192, 8192], [1, 0, 1, 0], [4096, 4096, 0, 0], [4096, 10, 4096, 4096], 4096)
    assert not columns.ranges_ok([8192, 8192], [1, 0, 1, 0], [4096, 0, 0, 0], [4096, 10, 8192, 4096], 4096)
    # Two shards laid end to end do not make ranges of different shards overlap, nor empty ranges count.
    assert columns.ranges_ok([4096, 4096], [0, 1, 0], [0, 0, 4096], [4096, 4096, 0], 4096)
    assert not columns.ranges_ok([4096], [0], [0], [4097], 4096)


def test_the_seal_shortcut_only_ever_accepts_the_bytes_that_were_hashed():
    doc = document()
    data = seal(doc)
    expected = json.loads(data)["checksum"][MANIFEST_HASH_FIELD]
    assert sealing.raw_seal_matches(data, MANIFEST_HASH_FIELD, expected)
    # Another writer's whitespace: the shortcut declines, the spec's re-serialization accepts.
    spaced = json.dumps(json.loads(data), indent=1).encode()
    assert not sealing.raw_seal_matches(spaced, MANIFEST_HASH_FIELD, expected)
    assert Manifest.parse(spaced, path="m").manifest_verified
    # Damage anywhere (a value, or the recorded digest itself) still fails as before.
    damaged = data.replace(b'"offset":4096,', b'"offset":8192,', 1)
    assert not sealing.raw_seal_matches(damaged, MANIFEST_HASH_FIELD, expected)
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
        Manifest.parse(damaged, path="m")
    wrong = data.replace(expected.encode(), b"0" * 64)
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
        Manifest.parse(wrong, path="m")


def reference_seal(doc: dict[str, Any]) -> bytes:
    """docs/format.md 4.3 literally: serialize without the field, hash, add it last, serialize again."""
    doc["checksum"].pop(MANIFEST_HASH_FIELD, None)
    digest = hashlib.sha256(json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()
    doc["checksum"][MANIFEST_HASH_FIELD] = digest
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda d: None, id="plain"),
        pytest.param(lambda d: d["checksum"].update(content="blake3"), id="content-hash"),
        pytest.param(lambda d: d["checksum"].update({MANIFEST_HASH_FIELD: "0" * 64}), id="resealed"),
        pytest.param(lambda d: d["library"].update(checksum={"algorithm": "crc32c"}), id="lookalike-before"),
        pytest.param(lambda d: d["metadata"].update(note='"checksum":{}, é'), id="lookalike-after"),
        pytest.param(lambda d: d.update(checksum={}), id="empty-checksum"),
    ],
)
def test_seal_serializes_once_with_the_bytes_of_the_spec(edit):
    doc = document(20)
    edit(doc)
    assert seal(copy.deepcopy(doc)) == reference_seal(copy.deepcopy(doc))


@pytest.mark.parametrize(("depth", "fragment"), [(600, "nested deeper than 512 levels"), (505, "shape[0] must be")])
def test_the_tensor_tables_depth_is_still_capped(depth, fragment):
    doc = document()
    doc["tensors"]["layer.151.w"]["shape"] = json.loads("[" * depth + "]" * depth)
    with pytest.raises(FormatError, match=re.escape(fragment)):
        Manifest.parse(seal(doc), path="m")
    doc["tensors"] = json.loads("[" * depth + "]" * depth)
    with pytest.raises(FormatError, match="nested deeper than 512 levels" if depth > 510 else "must be an object"):
        Manifest.parse(seal(doc), path="m")
