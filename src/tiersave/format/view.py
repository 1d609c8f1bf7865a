"""One rank's view of a collective manifest: only the rows and the subtree that rank restores are built.

Scope: what ``Manifest.parse(..., part=RankPart(...))`` keeps of a manifest written by several ranks: the
rank's own tensors (``rank-RRRRR/...``) and the replicated ones every rank reads (``replicated/...``), its
subtree of the tree (``tree["rank-RRRRR"]``), and the checks that make that view as trustworthy as a whole
parse for everything it names: its subtree's grammar, that the subtree references only tensors of the view
and every tensor of the rank's own, that its runs stay inside the view.
Anti-scope: the checks of the whole document, which the view parse still runs over every row (the seal over
the raw bytes, the version, the shards, every column of the table, every tensor's byte range: ``manifest.py``,
``compact.py``); which rank a process is and the replicated tensors' order (``collective.py``).

Why: every rank of a job restores from the one global manifest; built whole, its tree and its entries cost
each rank CPU in proportion to the whole job's tensor count (8 ranks x 50,000 tensors: 8 parses of 400,000
entries on one machine; docs/benchmarks.md, "The restore at many ranks x many tensors"). The table's checks
run in C over whole columns; the per-tensor Python work (an entry per tensor, the tree's nodes) is what the
view limits to the rank's own part.
"""

from __future__ import annotations

from collections.abc import KeysView
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any, cast

from .columns import Columns, Fail


@dataclass(frozen=True, slots=True)
class RankPart:
    """The part of a collective checkpoint one rank restores.

    Attributes:
        rank: the rank.
        key: its subtree's key in the manifest's tree (``rank-00003``).
        own: the prefix of its own tensors' names (``rank-00003/``); every one of them is in the view.
        shared: the prefix of the tensors every rank reads (``replicated/``); in the view, and the subtree
            may leave some unreferenced.
    """

    rank: int
    key: str
    own: str
    shared: str

    def applies(self, world_size: int) -> bool:
        """Whether a manifest of ``world_size`` ranks has this part: a single-rank checkpoint, or one without
        this rank (another world size, which the caller reports by name), is parsed whole."""
        return world_size > 1 and 0 <= self.rank < world_size

    def keeps(self, name: str) -> bool:
        return name.startswith((self.own, self.shared))


def select_rows(columns: Columns, part: RankPart) -> Columns:
    """The rows of ``columns`` (checked, whole) whose names are in ``part``, in table order."""
    names = columns[0]
    keep = list(map(str.startswith, names, repeat((part.own, part.shared))))
    if all(keep):
        return columns
    rows = list(compress(range(len(names)), keep))
    return cast("Columns", tuple(list(map(column.__getitem__, rows)) for column in columns))


def subtree(tree: Any, part: RankPart, fail: Fail) -> Any:
    """The rank's subtree of a collective manifest's tree (a dict keyed by ``rank-RRRRR``)."""
    if type(tree) is not dict:
        raise fail(f"tree of a checkpoint of several ranks must be an object keyed by rank, not {type(tree).__name__}")
    if part.key not in tree:
        raise fail(f"the manifest has no state for rank {part.rank} (no {part.key!r} in its tree)")
    return tree[part.key]


def shared_names(names: list[str], part: RankPart) -> list[str]:
    """The view's replicated tensors: the subtree need not reference them all (the whole parse checks that
    some rank's subtree does)."""
    return [name for name in names if name.startswith(part.shared)]


def check_runs_inside(referenced: list[str], names: KeysView[str], part: RankPart, fail: Fail) -> None:
    """The tensors the subtree's runs stand for must be tensors of the view: a run's first and count index the
    whole table, so a forged run could otherwise hand this rank another rank's row."""
    outside = [name for name in referenced if name not in names]
    if outside:
        raise fail(f"the tree of rank {part.rank} references tensor {outside[0][:80]!r}, outside its part")
