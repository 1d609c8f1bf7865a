"""The compact tensor table of format 4.0 (docs/format.md 4.4): it reads back to exactly the manifest the
per-entry table gives, older readers refuse it by its version, and every check of the per-entry table holds
on it, each failure naming the tensor; the ``$tensors`` runs of the tree cannot reference a tensor twice,
outside the table or under another prefix."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import tiersave
from helpers import accepted_bit_flips, compact_written, manifest_doc
from helpers import manifest_error as parse_error
from tiersave.errors import FormatError, UnsupportedFormatVersionError
from tiersave.format import compact
from tiersave.format.manifest import Manifest, seal

CHUNK = 8192


def entry_document() -> dict[str, Any]:
    """A per-entry (1.2) manifest with what a table may hold: mixed dtypes and shapes, two shards, an empty
    tensor, a tensor of three checksum chunks, names with and without shared prefixes, a tied tensor (two
    tree leaves), tensors outside any run (an ndarray leaf, a tensor in a list) and user keys starting with
    ``$``."""
    specs = [
        ("model.layers.0.w", "float32", [4, 256], 0),
        ("model.layers.0.b", "bfloat16", [512], 0),
        ("model.layers.1.w", "float32", [4, 256], 1),
        ("model.layers.1.b", "bfloat16", [512], 1),
        ("model.big", "float64", [2560], 1),  # 20,480 bytes: three chunks of 8192
        ("model.$odd", "int8", [0], 0),  # empty; its tree key is escaped ("$$odd"), so it is in no run
        ("opt.0.exp_avg", "float32", [3, 5], 0),
        ("opt.0.exp_avg_sq", "float32", [3, 5], 0),
        ("über.σ", "uint8", [], 1),
        ("arr", "int64", [2, 2], 0),
        ("listed", "bool", [7], 1),
    ]
    offsets = [0, 0]
    tensors = {}
    for i, (name, dtype, shape, shard) in enumerate(specs):
        nbytes = {"float32": 4, "bfloat16": 2, "int8": 1, "float64": 8, "uint8": 1, "int64": 8, "bool": 1}[dtype]
        for d in shape:
            nbytes *= d
        chunks = -(-nbytes // CHUNK)
        tensors[name] = {
            "dtype": dtype,
            "shape": shape,
            "shard": shard,
            "offset": offsets[shard],
            "nbytes": nbytes,
            "crc32c": [f"{(i * 7919 + c) & 0xFFFFFFFF:08x}" for c in range(chunks)],
        }
        offsets[shard] += -(-nbytes // 4096) * 4096
    tree = {
        "model": {
            "$stateful": {
                "type": "M",
                "state": {
                    "layers.0.w": {"$tensor": "model.layers.0.w"},
                    "layers.0.b": {"$tensor": "model.layers.0.b"},
                    "layers.1.w": {"$tensor": "model.layers.1.w"},
                    "layers.1.b": {"$tensor": "model.layers.1.b"},
                    "big": {"$tensor": "model.big"},
                },
            }
        },
        "opt": {
            "$dict": [[0, {"exp_avg": {"$tensor": "opt.0.exp_avg"}, "exp_avg_sq": {"$tensor": "opt.0.exp_avg_sq"}}]]
        },
        "tied": {"$tensor": "model.layers.0.w"},
        "$$odd": {"$tensor": "model.$odd"},
        "u": {"über.σ": {"$tensor": "über.σ"}},
        "arr": {"$ndarray": "arr"},
        "listed": [{"$tensor": "listed"}, 3],
    }
    shards = [
        {"file": "shard-00000-000.bin", "rank": 0, "size": offsets[0], "content": [[offsets[0], "a" * 64]]},
        {"file": "shard-00001-000.bin", "rank": 1, "size": offsets[1]},
    ]
    return manifest_doc(
        tensors, tree, shards, world_size=2, version="1.2", step=5, chunk_bytes=CHUNK, metrics={"loss": 0.5}
    )


def compact_doc() -> dict[str, Any]:
    """The manifest of :func:`entry_document` as a 4.0 writer writes it."""
    return compact_written(entry_document())


def test_the_compact_table_reads_back_as_the_entries_do():
    from_entries = Manifest.parse(seal(entry_document()), path="entries")
    doc = compact_doc()
    assert doc["format_version"] == "4.0" and "tensors" not in doc
    assert list(doc) == [*list(entry_document())[:8], "table", "tree", "metrics", "tags", "metadata", "stats"]
    # the model's five tensors and the optimizer's two are runs; the tied, escaped, ndarray and listed leaves
    # are not
    assert doc["tree"]["model"]["$stateful"]["state"] == {"$tensors": ["model.", 0, 5]}
    assert doc["tree"]["opt"]["$dict"][0][1] == {"$tensors": ["opt.0.", 6, 2]}
    assert doc["tree"]["tied"] == {"$tensor": "model.layers.0.w"}
    assert doc["table"]["names"][0][:4] == [0, 15, 13, 15]  # front-coded against the name before
    assert doc["table"]["crc32c"] == "".join(c for t in entry_document()["tensors"].values() for c in t["crc32c"])
    from_compact = Manifest.parse(json.dumps(doc, ensure_ascii=False).encode(), path="compact")
    assert from_compact == dataclasses.replace(from_entries, format_version="4.0")
    assert from_compact.tree == entry_document()["tree"]  # key order too


def test_small_manifests_keep_the_per_entry_table_that_older_readers_read():
    m = Manifest.parse(seal(entry_document()), path="entries")
    assert len(m.tensors) < compact.COMPACT_MIN_TENSORS
    doc = json.loads(m.to_json())
    assert doc["format_version"] == "1.2" and "tensors" in doc and "table" not in doc


def test_a_named_content_hash_makes_it_4_1(compact_always):
    m = dataclasses.replace(Manifest.parse(seal(entry_document()), path="e"), content_hash="blake3")
    data = m.to_json()
    assert json.loads(data)["format_version"] == "4.1"
    assert Manifest.parse(data, path="m").content_hash == "blake3"


def test_a_3x_reader_refuses_4_0_by_its_version(monkeypatch):
    data = seal(compact_doc())
    monkeypatch.setattr("tiersave.format.manifest.READ_VERSIONS", {1: 3, 2: 1, 3: 1})
    with pytest.raises(UnsupportedFormatVersionError, match=r"written with format version 4\.0; .*reads 1\.x, 2\.x"):
        Manifest.parse(data, path="m.json")


def names_doc(names: list[str]) -> dict[str, Any]:
    """A compact document whose first tensors are renamed ``names`` (front-coded by hand)."""
    doc = compact_doc()
    shared, suffixes = doc["table"]["names"]
    for i, name in enumerate(names):
        shared[i], suffixes[i] = 0, name
    shared[len(names)], suffixes[len(names)] = 0, "model.layers.0.b"
    return doc


def table(field: str, fn):
    def edit(doc: dict[str, Any]) -> None:
        doc["table"][field] = fn(doc["table"][field])

    return edit


def offsets(fn):
    """Edit the offsets as absolute byte offsets; they are written back delta-coded in 4096-byte units."""

    def edit(doc: dict[str, Any]) -> None:
        absolute = [4096 * u for u in itertools.accumulate(doc["table"]["offset"])]
        absolute = fn(absolute)
        units = [o // 4096 for o in absolute]
        doc["table"]["offset"] = [b - a for a, b in zip([0, *units[:-1]], units)]

    return edit


def at(i: int, value: Any):
    def put(column: list[Any]) -> list[Any]:
        column[i] = value
        return column

    return put


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        # names: empty, too long, NUL, duplicates, front coding that does not decode
        (lambda d: d.update(names_doc([""])), "tensor name '' is empty, too long or contains NUL"),
        (lambda d: d.update(names_doc(["x" * 1025])), "is empty, too long or contains NUL"),
        (lambda d: d.update(names_doc(["a\x00b"])), "tensor name 'a\\x00b' is empty, too long or contains NUL"),
        (lambda d: d.update(names_doc(["model.layers.0.b"])), "tensor name 'model.layers.0.b' appears twice"),
        (
            table("names", lambda n: [[5, *n[0][1:]], n[1]]),
            "shared prefix lengths must be one integer per name, the first 0",
        ),
        (
            table("names", lambda n: [[0, 99, *n[0][2:]], n[1]]),
            "tensor 'model.layers.0.wb' shares more characters with the name before it than that name has",
        ),
        (table("names", lambda n: [[0, True, *n[0][2:]], n[1]]), "shared prefix lengths must be one integer"),
        (table("names", lambda n: [n[0], [*n[1][:-1], 7]]), "suffixes must be strings"),
        (table("names", lambda n: [n[0][:-1], n[1]]), "shared prefix lengths must be one integer per name"),
        (table("names", lambda n: {"shared": n[0]}), "table.names must be [shared prefix lengths, suffixes]"),
        # names with a non-ASCII character ('über.σ') count 4 bytes a character: 1135 characters, 4540 bytes
        (lambda d: d.update(names_doc(["y" * 1024])), "table.names decode to 4540 bytes of characters, over the 1100"),
        (lambda d: d.update(names_doc(["é" * 162])), "table.names decode to 1092 bytes of characters, over the 1000"),
        # dtypes and shapes: unknown, out of the tables, too many dimensions, negative, nbytes overflow
        (table("dtypes", lambda t: [*t[:-1], "float128"]), "table.dtypes has unknown dtype 'float128'"),
        (table("dtypes", lambda t: [*t[:-1], 3]), "table.dtypes has unknown dtype 'int'"),
        (
            table("dtype", at(1, 99)),
            "tensor 'model.layers.0.b' dtype index is not an integer in [0, 6] (an index into table.dtypes)",
        ),
        (table("dtype", at(1, -1)), "tensor 'model.layers.0.b' dtype index is not an integer"),
        (table("shape", at(2, 1.0)), "tensor 'model.layers.1.w' shape index is not an integer"),
        (table("shapes", lambda s: [*s, [1] * 65]), "has a shape of more than 64 dimensions"),
        (table("shapes", lambda s: [[-1], *s[1:]]), "table.shapes dimensions must be integers in [0, "),
        (table("shapes", lambda s: [[2**62, 2**62], *s[1:]]), "tensor 'model.layers.0.w' nbytes is over"),
        (table("shapes", lambda s: {"0": [1]}), "table.shapes must be an array of shapes"),
        # shards, offsets, ranges
        (table("shard", at(3, 2)), "tensor 'model.layers.1.b' shard index is not an integer in [0, 1]"),
        (table("shard", lambda s: s[:-1]), "table.shard must be an array of 11 integers, one per tensor"),
        (table("offset", at(0, -1)), "tensor 'model.layers.0.w' offset is out of range"),
        (table("offset", at(1, 0.5)), "tensor 'model.layers.0.b' offset delta is not an integer"),
        (offsets(at(1, 0)), "tensors 'model.layers.0.b' and 'model.layers.0.w' overlap in their shard"),
        (offsets(at(10, 4096 * 9)), "tensor 'listed' range [36864, 36871) exceeds shard shard-00001-000.bin of 36864"),
        (table("offset", at(0, 2**51)), "tensor 'model.layers.0.w' offset is out of range [0, "),
        # checksums: count per chunk, hex digits
        (table("crc32c", lambda c: c[:-8]), "table.crc32c has 88 hex digits for 12 chunks (8 per chunk)"),
        (table("crc32c", lambda c: c + "00000000"), "table.crc32c has 104 hex digits for 12 chunks"),
        (table("crc32c", lambda c: c.upper()), "table.crc32c must be one string of lowercase hex digits"),
        (table("crc32c", lambda c: c[:-1] + "\n"), "table.crc32c must be one string of lowercase hex digits"),
        (table("crc32c", lambda c: [c]), "table.crc32c must be one string of lowercase hex digits"),
        # the table object and the top level
        (lambda d: d["table"].update(extra=1), "table has unknown field(s) extra"),
        (lambda d: d["table"].pop("shape"), "table lacks field(s) shape"),
        (lambda d: d.update(table=[]), "table must be an object with the fields names, dtypes"),
        (lambda d: d.update(tensors={}), "manifest has unknown field(s) tensors"),
        (lambda d: d.pop("table"), "manifest lacks field(s) table"),
        (lambda d: d.update(format_version="3.1", tensors={}), "manifest has unknown field(s) table"),
    ],
)
def test_every_per_entry_check_holds_on_the_compact_table(mutate, fragment, monkeypatch):
    # a forged front coding must not decode to gigabytes of names: a low bound shows the check
    monkeypatch.setattr(compact, "MAX_NAME_BYTES", 1000 if "1000" in fragment else 1100)
    doc = compact_doc()
    mutate(doc)
    assert fragment in parse_error(doc)


def run_at(doc: dict[str, Any]) -> list[Any]:
    return doc["tree"]["model"]["$stateful"]["state"]["$tensors"]


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: run_at(d).__setitem__(2, 4), "the tree never uses: model.big"),
        (lambda d: run_at(d).__setitem__(2, 12), "must be [prefix, first, count] naming some of the 11 tensors"),
        (lambda d: run_at(d).__setitem__(2, 0), "must be [prefix, first, count]"),
        (lambda d: run_at(d).__setitem__(1, -1), "must be [prefix, first, count]"),
        (lambda d: run_at(d).__setitem__(0, 5), "must be [prefix, first, count]"),
        (lambda d: run_at(d).append(1), "must be [prefix, first, count]"),
        (lambda d: run_at(d).__setitem__(0, "opt."), "tensor 'model.layers.0.w' does not start with the run's prefix"),
        (lambda d: d["tree"].update(again={"$tensors": ["opt.0.", 6, 2]}), "run of tensors 6..7 overlaps another run"),
        (lambda d: d["tree"].update(more={"$tensor": "nope"}), "references unknown tensor 'nope'"),
        # a run of one whose key reads as a tag is decoded as that tag, as the whole dict would be
        (
            lambda d: d["tree"].update(t={"$tensors": ["model.", 5, 1]}),
            "unknown tag '$odd'",
        ),
    ],
)
def test_tree_runs_are_checked(mutate, fragment):
    doc = compact_doc()
    mutate(doc)
    assert fragment in parse_error(doc)


def test_a_1x_tree_may_not_use_runs():
    doc = entry_document()
    doc["tree"]["u"] = {"$tensors": ["", 8, 1]}
    assert "unknown tag '$tensors'" in parse_error(doc)


def test_every_single_bit_flip_of_a_compact_manifest_is_rejected():
    assert accepted_bit_flips(seal(compact_doc())) == []


def test_a_forged_deep_table_is_a_format_error():
    doc = compact_doc()
    deep: Any = 1
    for _ in range(600):  # past the format's depth cap (512), so the table's own check is what answers
        deep = [deep]
    doc["table"]["shapes"] = [deep]
    assert "table.shapes dimensions must be integers" in parse_error(doc)
    doc["table"]["dtypes"] = [deep]
    assert "unknown dtype 'list'" in parse_error(doc)


def test_a_checkpoint_in_the_compact_encoding_restores_verifies_and_exports(root: Path, compact_always):
    g = torch.Generator().manual_seed(0)
    state = {
        "layers": {f"l{i}": torch.randn(3, i + 1, generator=g) for i in range(20)},
        "ids": torch.arange(10),
        "half": torch.randn(7, generator=g).bfloat16(),
    }
    state["tied"] = state["layers"]["l3"]
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state)
        doc = json.loads((root / "step-0000000001" / "manifest.json").read_bytes())
        assert doc["format_version"] == "4.0" and doc["tree"]["layers"] == {"$tensors": ["layers.", 0, 20]}
        out = ckpt.restore(1)
        assert ckpt.verify(1).ok
    assert all(torch.equal(out["layers"][k], v) for k, v in state["layers"].items())
    assert torch.equal(out["half"], state["half"]) and out["tied"] is out["layers"]["l3"]


def test_empty_tensors_beside_tensors_of_several_chunks_keep_their_own_checksums(
    root: Path, compact_always, monkeypatch
):
    """As many empty tensors as extra chunks make the chunk total equal the tensor count: the one-chunk-each
    shortcut must not take it for that case and hand each tensor its neighbour's checksums."""
    monkeypatch.setenv("TIERSAVE_CHUNK_BYTES", "4096")
    state = {"a": torch.empty(0), "b": torch.arange(2048, dtype=torch.float32)}  # 8 KiB: two chunks
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state)
        out = ckpt.restore(1)
        assert ckpt.verify(1).ok
    assert torch.equal(out["b"], state["b"]) and out["a"].numel() == 0
    doc = json.loads((root / "step-0000000001" / "manifest.json").read_bytes())
    assert doc["format_version"].startswith("4.")
    parsed = Manifest.parse((root / "step-0000000001" / "manifest.json").read_bytes(), path="manifest.json")
    assert parsed.tensors["a"].crc32c == () and len(parsed.tensors["b"].crc32c) == 2


def test_a_corrupt_compact_checkpoint_names_the_tensor_at_restore(root: Path, compact_always):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"a": torch.arange(3000, dtype=torch.float32), "b": torch.ones(5, 3, dtype=torch.int64)})
    path = root / "step-0000000001" / "manifest.json"
    doc = json.loads(path.read_bytes())
    edited = copy.deepcopy(doc)
    edited["table"]["offset"][1] = 0
    path.write_bytes(seal(edited))
    with (
        tiersave.Checkpointer(root) as ckpt,
        pytest.raises(tiersave.FormatError, match="tensors 'b' and 'a' overlap in their shard"),
    ):
        ckpt.restore(1)


@pytest.mark.slow
def test_a_state_of_350k_small_tensors_round_trips_bit_exact(tmp_path: Path):
    """350,208 tensors named like a mixture-of-experts model (228 layers x 128 experts x 3 projections) and
    its Adam state (step, exp_avg, exp_avg_sq per parameter): in the per-entry encoding the manifest is
    ~72 MB, over the 64 MiB cap, so the save failed before format 4.0; compact, it fits with room to spare,
    and the restore is bit-exact."""
    layers, experts, projections = 228, 128, ("gate_proj", "up_proj", "down_proj")
    names = [
        f"model.layers.{i}.mlp.experts.{e}.{p}.weight"
        for i in range(layers)
        for e in range(experts)
        for p in projections
    ]
    g = torch.Generator().manual_seed(15)
    weights = torch.randn(len(names), 4, generator=g).bfloat16()
    moments = torch.randn(len(names), 2, 3, generator=g)
    state = {
        "model": dict(zip(names, (w.clone() for w in weights), strict=True)),
        "optimizer": {
            "state": {
                i: {"step": torch.tensor(float(i)), "exp_avg": m[0].clone(), "exp_avg_sq": m[1].clone()}
                for i, m in enumerate(moments)
            }
        },
    }
    del weights, moments
    with tiersave.Checkpointer(tmp_path / "ckpt", event_log=False, handle_sigterm=False) as ckpt:
        assert ckpt.save(1, state).stats.num_tensors == 4 * len(names) > 350_000
        data = (tmp_path / "ckpt" / "step-0000000001" / "manifest.json").read_bytes()
        restored = ckpt.restore(1)
    doc = json.loads(data)
    assert doc["format_version"] == "5.0" and len(data) < 32 << 20
    # the optimizer's 87,552 parameters are one node of the tree (format 5.0)
    assert doc["tree"]["optimizer"]["state"]["$dictruns"][1:] == [["step", "exp_avg", "exp_avg_sq"], [[0, 87552]]]
    m = Manifest.parse(data, path="m")
    saved, compact.COMPACT_MIN_TENSORS = compact.COMPACT_MIN_TENSORS, 1 << 40
    try:
        with pytest.raises(FormatError, match="over the 67108864-byte limit"):
            m.to_json()  # what a save wrote before format 4.0
    finally:
        compact.COMPACT_MIN_TENSORS = saved

    def bits(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(ts).view(torch.int16 if ts[0].dtype == torch.bfloat16 else torch.int32)

    assert list(restored["model"]) == names
    assert torch.equal(bits(list(restored["model"].values())), bits(list(state["model"].values())))
    for key in ("step", "exp_avg", "exp_avg_sq"):
        got = [restored["optimizer"]["state"][i][key] for i in range(len(names))]
        assert torch.equal(bits(got), bits([state["optimizer"]["state"][i][key] for i in range(len(names))])), key
