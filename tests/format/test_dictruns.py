"""Format 5.0 (docs/format.md 4.4): an optimizer's state, an int-keyed ``$dict`` of dicts of the same tensor
fields, is one ``$dictruns`` node of the tree. It reads back to exactly the tree the per-entry table gives,
older readers refuse it by its version, and a forged node is refused with a ``FormatError`` naming what is
wrong before anything of its size is built. Also: the compact table's newer-minor fields, its size bounds,
and its decoder reached by corrupt-but-sealed tables."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import tiersave
from helpers import compact_written, manifest_doc
from helpers import manifest_error as parse_error
from tiersave.errors import FormatError, UnsupportedFormatVersionError
from tiersave.format import compact
from tiersave.format.jsonsafe import dumps_canonical
from tiersave.format.manifest import Manifest, seal

FIELDS = ("step", "exp_avg", "exp_avg_sq")
KEYS = (0, 1, 2, 4, 5, 9)  # parameters 3, 6-8 without state (no gradient yet)


def entry_document(keys: tuple[int, ...] = KEYS) -> dict[str, Any]:
    """A per-entry (1.1) manifest of a model of ``len(keys) + 3`` float32 tensors and an Adam-like state
    (``FIELDS`` under ``keys``), laid out as a save lays it out: the model's tensors, then the optimizer's,
    key after key, field after field."""
    names = [f"model.p{i}" for i in range(len(keys) + 3)]
    names += [f"optim.state.{k}.{f}" for k in keys for f in FIELDS]
    tensors = {
        name: {
            "dtype": "float32",
            "shape": [4],
            "shard": 0,
            "offset": 4096 * i,
            "nbytes": 16,
            "crc32c": [f"{(i * 2654435761) & 0xFFFFFFFF:08x}"],
        }
        for i, name in enumerate(names)
    }
    pairs = [[k, {f: {"$tensor": f"optim.state.{k}.{f}"} for f in FIELDS}] for k in keys]
    tree = {
        "model": {f"p{i}": {"$tensor": f"model.p{i}"} for i in range(len(keys) + 3)},
        "optim": {"state": {"$dict": pairs}, "param_groups": [{"lr": 0.1, "params": list(range(10))}]},
    }
    return manifest_doc(tensors, tree, [{"file": "shard-00000-000.bin", "rank": 0, "size": 4096 * len(names)}])


def test_an_optimizer_state_is_one_node_and_reads_back_as_the_entries_do():
    doc = compact_written(entry_document())
    assert doc["format_version"] == "5.0"
    assert doc["tree"]["optim"]["state"] == {"$dictruns": [9, list(FIELDS), [[0, 3], [4, 2], [9, 1]]]}
    assert doc["tree"]["model"] == {"$tensors": ["model.", 0, 9]}
    from_entries = Manifest.parse(seal(entry_document()), path="entries")
    parsed = Manifest.parse(seal(doc), path="compact")
    assert parsed == dataclasses.replace(from_entries, format_version="5.0")
    assert json.dumps(parsed.tree) == json.dumps(entry_document()["tree"])  # key order and pair lists too


def test_without_an_optimizer_like_dict_the_version_stays_4_0():
    doc = entry_document(keys=(7,))  # one key: a $dict of one pair is left as it was
    out = compact_written(doc)
    assert out["format_version"] == "4.0" and "$dictruns" not in json.dumps(out)
    assert out["tree"]["optim"]["state"]["$dict"] == [[7, {"$tensors": ["optim.state.7.", 4, 3]}]]


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda p: p[1].__setitem__(1, dict(reversed(p[1][1].items()))), "fields in another order"),
        (lambda p: p[0][1].pop("step"), "another set of fields"),
        (lambda p: p[0].__setitem__(0, "0"), "a string key"),
        (lambda p: p[0].__setitem__(0, -1), "a negative key"),
        (lambda p: p.reverse(), "keys not ascending"),
        (lambda p: p[0][1].__setitem__("step", 3.0), "a value that is no tensor"),
        (lambda p: p[1][1].__setitem__("exp_avg", p[0][1]["exp_avg"]), "a tensor of another key (tied)"),
    ],
)
def test_a_dict_that_is_not_exactly_the_shape_keeps_the_4_0_form(edit, why):
    doc = entry_document()
    edit(doc["tree"]["optim"]["state"]["$dict"])
    if why == "a tensor of another key (tied)":
        doc["tensors"].pop("optim.state.1.exp_avg")
        for i, entry in enumerate(doc["tensors"].values()):
            entry["offset"] = 4096 * i
    if why in ("another set of fields", "a value that is no tensor"):
        doc["tree"]["optim"]["step0"] = {"$tensor": "optim.state.0.step"}
    out = compact_written(doc)
    assert "$dictruns" not in json.dumps(out), why
    assert Manifest.parse(seal(out), path="m").tree == Manifest.parse(seal(doc), path="m").tree


def test_a_4x_reader_refuses_5_0_by_its_version(monkeypatch):
    data = seal(compact_written(entry_document()))
    monkeypatch.setattr("tiersave.format.manifest.READ_VERSIONS", {1: 3, 2: 1, 3: 1, 4: 1})
    with pytest.raises(UnsupportedFormatVersionError, match=r"format version 5\.0; .*and 4\.x only\. Upgrade"):
        Manifest.parse(data, path="m.json")


def test_a_4x_tree_may_not_use_dictruns():
    doc = compact_written(entry_document())
    doc["format_version"] = "4.0"
    assert "unknown tag '$dictruns'" in parse_error(doc)


def test_a_named_content_hash_makes_it_5_1(compact_always):
    m = Manifest.parse(seal(entry_document()), path="e")
    shard = dataclasses.replace(m.shards[0], content=((m.shards[0].size, "a" * 64),))
    data = dataclasses.replace(m, shards=(shard,), content_hash="blake3").to_json()
    assert json.loads(data)["format_version"] == "5.1"
    assert Manifest.parse(data, path="m").content_hash == "blake3"


def node(doc: dict[str, Any]) -> list[Any]:
    return doc["tree"]["optim"]["state"]["$dictruns"]


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda d: node(d).append(1), "must be [first, fields, key ranges]"),
        (lambda d: node(d).__setitem__(1, "step"), "must be [first, fields, key ranges]"),
        (lambda d: node(d).__setitem__(0, -1), "first must be an integer in [0, 27]"),
        (lambda d: node(d).__setitem__(0, True), "first must be an integer"),
        (lambda d: node(d).__setitem__(0, 28), "first must be an integer in [0, 27]"),
        (lambda d: node(d).__setitem__(1, []), "fields must be 1 to 27 distinct strings"),
        (lambda d: node(d).__setitem__(1, ["a", "a", "b"]), "fields must be 1 to 27 distinct strings"),
        (lambda d: node(d).__setitem__(1, ["a", 1, "b"]), "fields must be 1 to 27 distinct strings"),
        (lambda d: node(d).__setitem__(1, ["$tensor", "a", "b"]), "a field may not start with '$'"),
        (lambda d: node(d).__setitem__(1, ["a", "b", "c" * 1025]), "nor be longer than 1024 characters"),
        (lambda d: node(d).__setitem__(2, []), "key ranges must be 1 to 27 [start, count] pairs"),
        (lambda d: node(d).__setitem__(2, [[0, 3, 1]]), "key ranges must be 1 to 27 [start, count] pairs"),
        (lambda d: node(d).__setitem__(2, [[0, 0], [4, 2], [9, 1]]), "each key range must be [start >= 0, count"),
        (lambda d: node(d).__setitem__(2, [[-1, 3], [4, 2], [9, 1]]), "each key range must be [start >= 0, count"),
        (lambda d: node(d).__setitem__(2, [[0, 3], [4, True], [9, 1]]), "each key range must be [start >= 0"),
        (lambda d: node(d).__setitem__(2, [[0, 3], [2, 2], [9, 1]]), "keys must be ascending"),
        (lambda d: node(d).__setitem__(2, [[9, 1], [0, 3], [4, 2]]), "keys must be ascending"),
        (lambda d: node(d).__setitem__(2, [[0, 3], [4, 1], [2**63 - 1, 2]]), "keys must be ascending, in [0, "),
        (lambda d: node(d).__setitem__(2, [[0, 3], [4, 2], [9, 2]]), "runs past the 27 tensors of the table"),
        # a huge count is refused from the numbers, before a key or a leaf is made
        (lambda d: node(d).__setitem__(2, [[0, 10**12]]), "each key range must be [start >= 0, count"),
        (lambda d: node(d).__setitem__(2, [[0, 27]]), "tree $dictruns of 27 keys x 3 fields from tensor 9 runs past"),
        (lambda d: node(d).__setitem__(2, [[0, 3], [4, 2]]), "the tree never uses: optim.state.9.exp_avg"),
        (lambda d: node(d).__setitem__(0, 8), "overlaps another run"),
        (lambda d: d["tree"].update(again={"$dictruns": [12, ["x"], [[0, 1]]]}), "overlaps another run"),
        (lambda d: d["tree"].update(again={"$dictruns": [0, ["x"], [[0, 1]]]}), "overlaps another run"),
        (lambda d: d["tree"].update(again={"$tensors": ["optim.", 10, 1]}), "overlaps another run"),
        # a stand-in is checked by the tree's grammar: here as a dict key, which must be hashable
        (lambda d: d["tree"].update(k={"$dict": [[d["tree"]["optim"].pop("state"), 1]]}), "key of type dict is not"),
    ],
)
def test_forged_dictruns_are_refused_naming_the_fault(mutate, fragment):
    doc = compact_written(entry_document())
    mutate(doc)
    assert fragment in parse_error(doc)


def test_the_depth_cap_counts_the_levels_a_dictruns_stands_for():
    doc = compact_written(entry_document())
    deep: Any = doc["tree"]["optim"]["state"]
    for _ in range(124):  # the node at level 126: its $dict's values at 127, their leaves at 128
        deep = [deep]
    doc["tree"]["optim"]["state"] = deep
    assert Manifest.parse(seal(doc), path="m").tree["optim"]["state"]
    doc["tree"]["optim"]["state"] = [deep]
    assert "nested deeper than 128 levels" in parse_error(doc)


# Review findings of format 4.x -----------------------------------------------------------------------


def test_a_table_field_of_a_newer_minor_version_is_ignored_and_of_a_known_one_refused():
    """docs/format.md 4.2 step 3: fields a reader does not know are an error when the minor version is one it
    knows, and ignored when it is newer (a newer minor only adds fields a reader may ignore)."""
    doc = compact_written(entry_document(keys=(7,)))
    doc["table"]["hint"] = [1, 2, 3]
    for version in ("4.0", "4.1"):
        doc["format_version"] = version
        if version == "4.1":
            doc["checksum"]["content"] = "blake3"
        assert "table has unknown field(s) hint" in parse_error(doc)
    doc["format_version"] = "4.2"
    parsed = Manifest.parse(seal(doc), path="m")
    assert len(parsed.tensors) == 7 and parsed.format_version == "4.2"
    doc["table"].pop("crc32c")  # a newer minor may add fields, never take one away
    assert "table lacks field(s) crc32c" in parse_error(doc)


def test_more_tensors_than_a_table_may_hold_are_refused_from_the_count(monkeypatch):
    doc = compact_written(entry_document())
    monkeypatch.setattr(compact, "MAX_TENSORS", 26)
    assert "table.names has 27 names, over the limit of 26 tensors" in parse_error(doc)
    m = Manifest.parse(seal(entry_document()), path="e")
    monkeypatch.setattr(compact, "COMPACT_MIN_TENSORS", 1)
    with pytest.raises(FormatError, match="27 tensors: a manifest holds at most 26"):
        m.to_json()  # the writer refuses what a reader would


def test_ascii_names_count_one_byte_a_character(monkeypatch):
    doc = compact_written(entry_document())
    total = sum(len(n) for n in Manifest.parse(seal(doc), path="m").tensors)
    monkeypatch.setattr(compact, "MAX_NAME_BYTES", total)
    Manifest.parse(seal(doc), path="m")
    monkeypatch.setattr(compact, "MAX_NAME_BYTES", total - 1)
    assert f"table.names decode to {total} bytes of characters, over the {total - 1} limit" in parse_error(doc)
    m = Manifest.parse(seal(entry_document()), path="e")
    monkeypatch.setattr(compact, "COMPACT_MIN_TENSORS", 1)
    with pytest.raises(FormatError, match="the tensor names take over"):
        m.to_json()


def sealed_flips(doc: dict[str, Any], fields: tuple[str, ...]) -> list[tuple[int, dict[str, Any]]]:
    """Every single-bit flip of the bytes of ``doc``'s ``fields`` that is still JSON, resealed: what the
    decoder itself must refuse or read (the seal no longer stands in front of it). (position, document)."""
    data = dumps_canonical(doc)
    out = []
    for field in fields:
        value = dumps_canonical(doc[field])
        start = data.index(b'"' + field.encode() + b'":' + value) + len(field) + 3
        for i in range(start, start + len(value)):
            for bit in range(8):
                flipped = bytearray(data)
                flipped[i] ^= 1 << bit
                try:
                    edited = json.loads(bytes(flipped).decode("utf-8"))
                except ValueError:
                    continue  # not JSON any more: refused before any decoder
                if type(edited) is dict and type(edited.get("checksum")) is dict:
                    out.append((i, edited))
    return out


@pytest.mark.parametrize("keys", [KEYS, (7,)], ids=["5.0", "4.0"])
def test_every_sealed_bit_flip_of_the_table_and_tree_is_refused_or_read_consistently(keys):
    """The seal catches every flip of a manifest; resealed, a flip reaches the table decoder and the runs'
    checks. Each must raise ``FormatError`` (never another exception) or give a manifest that writes back to
    a manifest equal to it."""
    doc = compact_written(entry_document(keys))
    refused: dict[str, int] = {}
    flips = sealed_flips(doc, ("table", "tree"))
    assert len(flips) > 1000
    for i, edited in flips:
        try:
            parsed = Manifest.parse(seal(edited), path="m")
        except FormatError as exc:
            what = str(exc).split(": ", 1)[1][:12]
            refused[what] = refused.get(what, 0) + 1
            continue
        except Exception as exc:  # the finding this test is for: any other error is a bug
            pytest.fail(f"flip at byte {i}: {type(exc).__name__}: {exc}")
        saved, compact.COMPACT_MIN_TENSORS = compact.COMPACT_MIN_TENSORS, 1
        try:
            again = Manifest.parse(parsed.to_json(), path="again")
        finally:
            compact.COMPACT_MIN_TENSORS = saved
        assert dataclasses.replace(again, format_version=parsed.format_version) == parsed, i
    # the decoder's and the runs' own checks answered (not only the tree grammar or the JSON)
    assert sum(n for w, n in refused.items() if w.startswith(("table", "tensor"))) > 200, refused


def test_a_checkpoint_with_an_optimizer_saves_as_5_0_and_restores(root: Path, compact_always):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, state)
        doc = json.loads((root / "step-0000000001" / "manifest.json").read_bytes())
        out = ckpt.restore(1)
        assert ckpt.verify(1).ok
    assert doc["format_version"] == "5.0"
    assert doc["tree"]["optim"]["state"]["$dictruns"][1:] == [["step", "exp_avg", "exp_avg_sq"], [[0, 4]]]
    for k, s in state["optim"]["state"].items():
        assert all(torch.equal(out["optim"]["state"][k][f], v) for f, v in s.items())
    fresh = torch.optim.Adam(model.parameters(), lr=0.01)
    fresh.load_state_dict(out["optim"])
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
