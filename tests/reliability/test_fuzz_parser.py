"""Fuzzing the manifest and state-tree parser with hypothesis, under an audit hook.

Targets: ``Manifest.parse`` followed by the tree decoding a restore does (``decode_placeholders``), fed
(a) a real manifest with structural mutations (values replaced by arbitrary JSON, keys deleted, list
entries duplicated or swapped), resealed so that its checksum matches and only the validation stands in
the way, or left unsealed; (b) a real manifest with raw byte damage (flips, truncation, insertion); and
the tree decoder (``validate_tree``) fed arbitrary JSON trees built from the tag grammar. The manifest
targets run on both tensor-table encodings: per entry (1.x) and compact (4.0, columns and tensor runs).

Every input must either parse or raise a ``TiersaveError``; while the parser runs, an audit hook records
any event that would mean code ran or the outside was touched (exec, compile, import, subprocess,
pickle, marshal, ctypes, sockets, opening files), and there must be none. The hook is shown to see such
events. 200 examples per target by default, 5000 with ``--long``; hypothesis prints the failing example.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
import sys
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiersave
from tiersave.collective import merge_parts, rank_part, rank_view, view_part
from tiersave.format import compact
from tiersave.format.manifest import Manifest, seal
from tiersave.format.tree import TAGS, validate_tree
from tiersave.state import decode_placeholders

FORBIDDEN = (
    "exec",
    "compile",
    "import",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.fork",
    "os.spawn",
    "pickle.find_class",
    "marshal.loads",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "socket.connect",
    "open",
)


class Audit:
    """One process-wide audit hook (they cannot be removed), recording forbidden events while armed."""

    armed = False
    events: ClassVar[list[tuple[str, str]]] = []
    installed = False

    @classmethod
    def install(cls) -> None:
        if not cls.installed:
            sys.addaudithook(cls._hook)
            cls.installed = True

    @classmethod
    def _hook(cls, event: str, args: tuple) -> None:
        if cls.armed and event in FORBIDDEN:
            cls.events.append((event, repr(args)[:100]))

    @classmethod
    def run(cls, fn, *args: Any) -> Any:
        cls.armed = True
        try:
            return fn(*args)
        finally:
            cls.armed = False


def parse_like_restore(data: bytes) -> None:
    """The whole parse, then rank 1's view of a 2-rank checkpoint (docs/format.md 4.5; the whole parse again for
    a manifest of one rank), each tried on its own: either may refuse what the other accepts."""
    failure: tiersave.TiersaveError | None = None
    for part in (None, view_part(1, 2)):
        try:
            m = Manifest.parse(data, path="fuzz/manifest.json", part=part)
            decode_placeholders(rank_view(m, 1, 2).tree if m.part is not None else m.tree)
        except tiersave.TiersaveError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


@pytest.fixture(scope="module", params=["entries", "compact", "collective"])
def base_doc(tmp_path_factory, request) -> dict:
    """A real manifest with every kind of value a tree holds, with its tensor table per entry (1.x) and as
    columns with tensor runs in the tree (4.0, docs/format.md 4.4); and two ranks' parts of it merged into a
    compact global manifest, as rank 0 commits it, which a rank's restore parses as its view."""
    root = tmp_path_factory.mktemp("fuzz") / "ckpt"
    state = {
        "model": {"w": torch.randn(8, 4), "b": torch.zeros(3, dtype=torch.bfloat16)},
        "opt": {
            "state": {0: {"step": 3, "exp_avg": torch.ones(4)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}],
        },
        "misc": {"nan": math.nan, "inf": -math.inf, "bytes": b"\x00\xff", "none": None, "flag": True, "$odd": "k"},
        "step": 7,
    }
    saved = compact.COMPACT_MIN_TENSORS
    compact.COMPACT_MIN_TENSORS = 1 if request.param != "entries" else saved
    try:
        with tiersave.Checkpointer(root, event_log=False) as ckpt:
            ckpt.save(7, state, metrics={"loss": 0.5}, tags=["t"])
        data = (root / "step-0000000007" / "manifest.json").read_bytes()
        if request.param == "collective":
            m = Manifest.parse(data, path="fuzz")
            parts = [json.loads(json.dumps(rank_part(r, m.shards, m.tensors, m.tree))) for r in (0, 1)]
            for r, part in enumerate(parts):  # each rank's own shard files, as a collective save names them
                for i, shard in enumerate(part["shards"]):
                    shard["file"] = f"shard-{r:05d}-{i:03d}.bin"
            merged = merge_parts(7, parts, chunk_bytes=m.chunk_bytes, metrics={}, tags=(), metadata={}, stats={})
            data = merged.to_json()
    finally:
        compact.COMPACT_MIN_TENSORS = saved
    doc = json.loads(data)
    assert ("table" in doc) == (request.param != "entries") and doc["world_size"] == (
        2 if request.param == "collective" else 1
    )
    Audit.install()
    parse_like_restore(seal(copy.deepcopy(doc)))  # warm: every lazy import is done before the hook is armed
    if "tensors" in doc:
        validate_tree(doc["tree"], set(doc["tensors"]))
    return doc


def check(fn, *args: Any) -> str:
    """Run a target: 'ok' or the TiersaveError's name; anything else, or a forbidden event, fails."""
    Audit.events.clear()
    try:
        Audit.run(fn, *args)
        outcome = "ok"
    except tiersave.TiersaveError as exc:
        outcome = type(exc).__name__
    assert not Audit.events, f"code ran or the outside was touched while parsing: {Audit.events}"
    return outcome


def json_values() -> st.SearchStrategy:
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
        st.sampled_from([*sorted(TAGS), "$$x", "$", "nan", "-inf", "AAAA", "float32", "uint8"]),
    )

    def extend(children: st.SearchStrategy) -> st.SearchStrategy:
        keys = st.one_of(st.text(max_size=6), st.sampled_from(sorted(TAGS)))
        return st.one_of(
            st.lists(children, max_size=4),
            st.dictionaries(keys, children, max_size=4),
            st.builds(lambda tag, v: {tag: v}, st.sampled_from(sorted(TAGS)), children),
        )

    return st.recursive(leaves, extend, max_leaves=20)


JSON = json_values()  # built once: building a recursive strategy costs more than drawing from it


def strings_under_tags(node: Any, tags: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in tags and isinstance(v, str):
                out.append(v)
            out += strings_under_tags(v, tags)
    elif isinstance(node, list):
        for v in node:
            out += strings_under_tags(v, tags)
    return out


def paths_of(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += paths_of(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += paths_of(v, (*prefix, i))
    return out


def mutate(doc: dict, path: tuple, op: str, value: Any) -> None:
    if not path:
        return
    parent = doc
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if op == "replace":
        parent[last] = value
    elif op == "delete":
        del parent[last]
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(last, copy.deepcopy(parent[last]))
    elif op == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = (last + 1) % len(parent)
        parent[last], parent[other] = parent[other], parent[last]
    elif op == "rename" and isinstance(parent, dict):
        parent[f"{last}_"] = parent.pop(last)


def examples(long_run: bool) -> settings:
    return settings(
        max_examples=5000 if long_run else 200,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


def test_the_audit_hook_sees_code_running(base_doc):
    Audit.events.clear()
    Audit.run(pickle.loads, pickle.dumps(Audit))  # find_class: what an unpickling parser would do
    sys.modules.pop("colorsys", None)  # another test may have imported it (matplotlib does): import it afresh
    Audit.run(lambda: __import__("colorsys"))
    seen = {event for event, _ in Audit.events}
    assert {"pickle.find_class", "import"} <= seen, seen


def test_fuzz_structured_manifest_mutations(base_doc, long_run):
    outcomes: dict[str, int] = {}

    @examples(long_run)
    @given(data=st.data(), reseal=st.booleans(), rounds=st.integers(1, 3))
    def run(data, reseal, rounds):
        doc = copy.deepcopy(base_doc)
        for _ in range(rounds):
            path = data.draw(st.sampled_from(paths_of(doc)))
            op = data.draw(st.sampled_from(["replace", "replace", "delete", "duplicate", "swap", "rename"]))
            mutate(doc, path, op, data.draw(JSON))
        raw = seal(doc) if reseal and isinstance(doc.get("checksum"), dict) else json.dumps(doc).encode()
        outcome = check(parse_like_restore, raw)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    run()
    print(f"fuzz manifest (structured): examples={sum(outcomes.values())} outcomes={outcomes} violations=0")


def test_fuzz_manifest_bytes(base_doc, long_run):
    outcomes: dict[str, int] = {}
    good = seal(copy.deepcopy(base_doc))

    @examples(long_run)
    @given(
        flips=st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)), max_size=4),
        cut=st.one_of(st.none(), st.integers(0, len(good))),
        insert=st.binary(max_size=8),
        where=st.integers(0, len(good)),
    )
    def run(flips, cut, insert, where):
        data = bytearray(good)
        for pos, xor in flips:
            data[pos] ^= xor
        data = data[:where] + insert + data[where:]
        damaged = bytes(data if cut is None else data[:cut])
        outcome = check(parse_like_restore, damaged)
        if outcome == "ok":  # accepted bytes (no change, or a change JSON ignores) must mean the same manifest
            assert Manifest.parse(damaged, path="m") == Manifest.parse(good, path="m"), "damage accepted silently"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    run()
    print(f"fuzz manifest (bytes): examples={sum(outcomes.values())} outcomes={outcomes} violations=0")


def test_fuzz_state_tree(base_doc, long_run):
    outcomes: dict[str, int] = {}

    @examples(long_run)
    @given(tree=JSON)
    def run(tree):
        # every name the tree references counts as a tensor of the manifest, so references can be valid
        names = {p for p in strings_under_tags(tree, ("$tensor", "$ndarray"))}
        outcome = check(validate_tree, tree, names)
        if outcome == "ok":
            outcome = check(decode_placeholders, tree)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    run()
    print(f"fuzz state tree: examples={sum(outcomes.values())} outcomes={outcomes} violations=0")
