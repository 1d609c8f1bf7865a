"""Runs of tensors in the tree of a compact manifest (docs/format.md 4.4): written once, expanded on parse.

Scope: the ``$tensors`` runs of format 4.x (a dict whose values are consecutive tensors of the table named
``prefix + key``) and the ``$dictruns`` of format 5.x (an int-keyed ``$dict`` whose values are dicts of the
same fields, each a tensor, all consecutive in the table: an optimizer's state); finding them in a tree
(writer), checking them against the table with bounded work before anything is built, and expanding them
back into the ``$tensor`` leaves they stand for (reader).
Anti-scope: the table's columns (``compact.py``), the tree's grammar (``tree.py``, which sees the stand-ins),
versions (``manifest.py``).

Why ``$dictruns``: in 4.x an optimizer's state was one ``[key, {"$tensors": run}]`` pair per parameter, so the
parse's tree checks and run handling were Python work per parameter (a third of the tensors of an Adam
state; docs/benchmarks.md, "The compact manifest"). A ``$dictruns`` node is O(1) for the whole optimizer;
its expansion is a few C-level passes (``map``, ``zip``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import chain, compress, repeat
from typing import Any

from .columns import Fail, ints
from .tree import T_DICT, T_TENSOR

T_RUN = "$tensors"
T_DICT_RUN = "$dictruns"
MAX_KEY = (1 << 63) - 1
"""The largest key of a ``$dictruns`` (keys are in [0, 2^63), as every integer of the manifest)."""
MAX_FIELD = 1024
"""The longest field name of a ``$dictruns`` (as a tensor name)."""


def _key_ranges(keys: list[int]) -> list[list[int]]:
    """Ascending keys as ``[start, count]`` ranges of consecutive keys: ``[[0, 33333]]`` for an optimizer whose
    every parameter has state."""
    ranges: list[list[int]] = []
    for key in keys:
        if ranges and ranges[-1][0] + ranges[-1][1] == key:
            ranges[-1][1] += 1
        else:
            ranges.append([key, 1])
    return ranges


def _is_leaf(v: Any) -> bool:
    return type(v) is dict and len(v) == 1 and type(v.get(T_TENSOR)) is str


def compress_tree(tree: Any, names: Sequence[str], *, dict_runs: bool = True) -> tuple[Any, bool]:
    """``tree`` with runs of consecutive tensors of the table written once, and whether a ``$dictruns`` is
    among them (format 5.x). :class:`TreeRuns` is its exact inverse.

    A ``$dict`` of at least two pairs, its keys ints in ascending order, each value a dict of the same fields
    (in the same order, none starting with ``$``), each a ``$tensor`` leaf, all of them consecutive tensors of
    the table, becomes ``{"$dictruns": [first, fields, key ranges]}`` (with ``dict_runs``). Any other dict
    whose values are all ``$tensor`` leaves of consecutive tensors named ``prefix + key`` becomes
    ``{"$tensors": [prefix, first, count]}``. Each tensor is in at most one run."""
    index = {name: i for i, name in enumerate(names)}
    used = bytearray(len(names))
    found_dict_run = False

    def take(refs: list[str]) -> int:
        """The index of the first of ``refs`` when they are consecutive unused tensors of the table (marked
        used), else -1."""
        first = index.get(refs[0], -1)
        if first < 0 or refs != names[first : first + len(refs)] or any(used[first : first + len(refs)]):
            return -1
        used[first : first + len(refs)] = b"\1" * len(refs)
        return first

    def run(node: dict[str, Any]) -> list[Any] | None:
        leaves = list(node.values())
        if not all(map(_is_leaf, leaves)):
            return None
        refs = [v[T_TENSOR] for v in leaves]
        keys = list(node)
        prefix = refs[0][: len(refs[0]) - len(keys[0])]
        if not refs[0].endswith(keys[0]) or list(map(operator.add, repeat(prefix), keys)) != refs:
            return None
        first = take(refs)
        return None if first < 0 else [prefix, first, len(refs)]

    def dict_run(pairs: Any) -> list[Any] | None:
        if type(pairs) is not list or len(pairs) < 2:
            return None
        if not all(type(p) is list and len(p) == 2 and type(p[0]) is int and type(p[1]) is dict for p in pairs):
            return None
        keys = [p[0] for p in pairs]
        if keys[0] < 0 or keys[-1] > MAX_KEY or not all(map(operator.lt, keys, keys[1:])):
            return None
        values = [p[1] for p in pairs]
        fields = list(values[0])
        if not fields or not all(type(f) is str and not f.startswith("$") and len(f) <= MAX_FIELD for f in fields):
            return None
        if not all(map(operator.eq, map(list, values), repeat(fields))):
            return None
        leaves = list(chain.from_iterable(map(dict.values, values)))
        if not all(map(_is_leaf, leaves)):
            return None
        first = take([v[T_TENSOR] for v in leaves])
        return None if first < 0 else [first, fields, _key_ranges(keys)]

    def walk(node: Any) -> Any:
        nonlocal found_dict_run
        if type(node) is list:
            return [walk(v) for v in node]
        if type(node) is not dict:
            return node
        if dict_runs and len(node) == 1 and T_DICT in node:
            found = dict_run(node[T_DICT])
            if found is not None:
                found_dict_run = True
                return {T_DICT_RUN: found}
        found = run(node) if node else None
        if found is not None:
            return {T_RUN: found}
        return {k: walk(v) for k, v in node.items()}

    return walk(tree), found_dict_run


class _DictRun:
    """A checked ``$dictruns``: its tensors are ``first`` to ``first + len(keys) * len(fields) - 1`` of the
    table, key after key, field after field."""

    __slots__ = ("counts", "fields", "first", "size", "starts")

    def __init__(self, raw: Any, n: int, fail: Fail) -> None:
        what = f"tree {T_DICT_RUN} must be [first, fields, key ranges]"
        if type(raw) is not list or len(raw) != 3 or type(raw[1]) is not list or type(raw[2]) is not list:
            raise fail(what)
        first, fields, ranges = raw
        if not ints([first], 0, n):
            raise fail(f"{what}: first must be an integer in [0, {n}]")
        if not fields or len(fields) > n or set(map(type, fields)) != {str} or len(set(fields)) != len(fields):
            raise fail(f"{what}: fields must be 1 to {n} distinct strings")
        if any(f.startswith("$") or len(f) > MAX_FIELD for f in fields):
            raise fail(f"{what}: a field may not start with '$' nor be longer than {MAX_FIELD} characters")
        # The ranges' sizes are bounded (by the tensors left in the table) before any key is made.
        if not ranges or len(ranges) > n or set(map(type, ranges)) != {list} or set(map(len, ranges)) != {2}:
            raise fail(f"{what}: key ranges must be 1 to {n} [start, count] pairs")
        starts, counts = map(list, zip(*ranges, strict=True))
        if not ints(starts, 0, MAX_KEY) or not ints(counts, 1, n):
            raise fail(f"{what}: each key range must be [start >= 0, count >= 1]")
        keys = sum(counts)
        if keys * len(fields) > n - first:
            raise fail(
                f"tree {T_DICT_RUN} of {keys} keys x {len(fields)} fields from tensor {first} runs past the "
                f"{n} tensors of the table"
            )
        ends = list(map(operator.add, starts, counts))
        if ends[-1] - 1 > MAX_KEY or not all(map(operator.le, ends, starts[1:])):
            raise fail(f"tree {T_DICT_RUN} keys must be ascending, in [0, {MAX_KEY}]")
        self.first, self.fields, self.starts, self.counts = first, fields, starts, counts
        self.size = keys * len(fields)

    def build(self, names: list[str], keys: int | None = None) -> dict[str, Any]:
        """The ``$dict`` it stands for, of its first ``keys`` keys (all: None)."""
        fields = self.fields
        width = len(fields)
        leaves = [{T_TENSOR: s} for s in names[self.first : self.first + (self.size if keys is None else keys * width)]]
        values = list(map(dict, map(zip, repeat(fields), zip(*(leaves[i::width] for i in range(width))))))
        key_list = chain.from_iterable(map(range, self.starts, map(operator.add, self.starts, self.counts)))
        return {T_DICT: list(map(list, zip(key_list, values)))}


class TreeRuns:
    """The runs of a parsed tree (docs/format.md 4.4), each checked to name tensors of the table, each tensor in
    at most one run, every name of a ``$tensors`` run starting with the run's prefix.

    A ``$tensors`` run stands for ``{name[len(prefix):]: {"$tensor": name}}`` over its tensors, a
    ``$dictruns`` for a ``$dict`` (:meth:`_DictRun.build`). The tree's grammar is checked (``validate_tree``)
    on :meth:`standins`, where each ``$tensors`` run is the dict of its first two tensors only and each
    ``$dictruns`` the ``$dict`` of its first key: a dict of two or more ``$tensor`` leaves is never a tag and
    each of its leaves is decoded the same way, so the grammar accepts the stand-in exactly when it accepts
    the whole run (a run of one is itself), and every key of a ``$dictruns`` is an int whose value has the
    same fields as the first's; the other names count as referenced (:meth:`referenced`). Then :meth:`expand`
    puts the whole runs in. The tree is changed in place; containers are walked level by level (no recursion;
    the parser capped the depth). ``dict_runs``: the tree may hold ``$dictruns`` (format 5.x); else the tag is
    left for the grammar to refuse as unknown."""

    def __init__(self, tree: Any, names: list[str], fail: Fail, *, dict_runs: bool) -> None:
        self.root = [tree]
        self.names = names
        self.sites: list[tuple[Any, Any]] = []
        self.dict_sites: list[tuple[Any, Any]] = []
        raws: list[Any] = []
        level: list[tuple[Any, Any]] = [(self.root, 0)]
        while level:
            nxt: list[tuple[Any, Any]] = []
            for parent, key in level:
                node = parent[key]
                if type(node) is dict:
                    if len(node) == 1 and T_RUN in node:
                        self.sites.append((parent, key))
                        raws.append(node[T_RUN])
                        continue
                    if dict_runs and len(node) == 1 and T_DICT_RUN in node:
                        self.dict_sites.append((parent, key))
                        continue
                    nxt.extend(zip(repeat(node), node))
                elif type(node) is list:
                    nxt.extend(zip(repeat(node), range(len(node))))
            level = list(compress(nxt, (type(p[k]) in (dict, list) for p, k in nxt)))
        self.dict_runs = [_DictRun(p[k][T_DICT_RUN], len(names), fail) for p, k in self.dict_sites]
        spans = [(d.first, d.size) for d in self.dict_runs]
        self.prefixes, self.firsts, self.counts = _check_runs(raws, names, spans, fail)

    def _put(self, take: int | None) -> Any:
        """Each run as the dict of its first ``take`` tensors (all: None), each ``$dictruns`` as the ``$dict`` of
        its first key (all: None); ``$tensors`` runs of at most two tensors are put by the first call only, their
        stand-in being the whole run."""
        names = self.names
        for (parent, key), prefix, first, count in zip(
            self.sites, self.prefixes, self.firsts, self.counts, strict=True
        ):
            if take is not None or count > 2:
                cut = len(prefix)
                parent[key] = {s[cut:]: {T_TENSOR: s} for s in names[first : first + min(count, take or count)]}
        for (parent, key), run in zip(self.dict_sites, self.dict_runs, strict=True):
            parent[key] = run.build(names, None if take is None else 1)
        return self.root[0]

    def standins(self) -> Any:
        """The tree with each run as its stand-in."""
        return self._put(2)

    def referenced(self) -> list[str]:
        """The names the runs reference beyond their stand-ins."""
        spans = map(slice, map(operator.add, self.firsts, repeat(2)), map(operator.add, self.firsts, self.counts))
        dict_spans = (slice(d.first + len(d.fields), d.first + d.size) for d in self.dict_runs)
        return list(chain.from_iterable(map(self.names.__getitem__, chain(spans, dict_spans))))

    def expand(self) -> Any:
        """The tree with each run as the whole dict it stands for (after :meth:`standins`)."""
        return self._put(None)


def _check_runs(
    raws: list[Any], names: list[str], spans: list[tuple[int, int]], fail: Fail
) -> tuple[list[str], list[int], list[int]]:
    """Each ``$tensors`` run's (prefix, first, count), checked run by run in C, none overlapping another or the
    ``spans`` (first, count) of the checked ``$dictruns``; on a fault, :func:`_check_run` in order finds and
    names the first faulty run."""
    n = len(names)
    ok = not raws or (set(map(type, raws)) == {list} and set(map(len, raws)) == {3})
    columns: list[list[Any]] = [list(c) for c in zip(*raws, strict=True)] if ok and raws else [[], [], []]
    prefixes, firsts, counts = columns
    ok = ok and (not raws or set(map(type, prefixes)) == {str}) and ints(firsts, 0, n) and ints(counts, 1, n)
    ends = list(map(operator.add, firsts, counts)) if ok else []
    ok = ok and (not ends or max(ends) <= n)
    if ok:  # no overlap: sorted by first, each run ends before the next begins
        all_firsts = firsts + [s for s, _ in spans]
        all_ends = ends + [s + c for s, c in spans]
        order = sorted(range(len(all_firsts)), key=all_firsts.__getitem__)
        ok = all(map(operator.le, map(all_ends.__getitem__, order), map(all_firsts.__getitem__, order[1:])))
    if ok:
        runs = map(slice, firsts, ends)
        ok = all(
            map(
                str.startswith,
                chain.from_iterable(map(names.__getitem__, runs)),
                chain.from_iterable(map(repeat, prefixes, counts)),
            )
        )
    if not ok:
        used = bytearray(n)
        for first, count in spans:
            _mark(used, first, count, T_DICT_RUN, fail)
        for raw in raws:
            _check_run(raw, names, used, fail)
        raise fail(f"tree {T_RUN} runs are malformed")  # unreachable while the two checks agree
    return prefixes, firsts, counts


def _mark(used: bytearray, first: int, count: int, tag: str, fail: Fail) -> None:
    if any(used[first : first + count]):
        raise fail(f"tree {tag} run of tensors {first}..{first + count - 1} overlaps another run")
    used[first : first + count] = b"\1" * count


def _check_run(raw: Any, names: list[str], used: bytearray, fail: Fail) -> tuple[str, int, int]:
    ok = type(raw) is list and len(raw) == 3 and type(raw[0]) is str and type(raw[1]) is type(raw[2]) is int
    if not ok or not (raw[1] >= 0 and raw[2] >= 1 and raw[1] + raw[2] <= len(names)):
        raise fail(f"tree {T_RUN} must be [prefix, first, count] naming some of the {len(names)} tensors")
    prefix, first, count = raw
    _mark(used, first, count, T_RUN, fail)
    run = names[first : first + count]
    if not all(map(str.startswith, run, repeat(prefix))):
        bad = next(s for s in run if not s.startswith(prefix))
        raise fail(f"tree {T_RUN}: tensor {bad[:80]!r} does not start with the run's prefix {prefix[:80]!r}")
    return prefix, first, count
