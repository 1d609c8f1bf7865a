"""Judging the split checks' documents (splitverify.py): a split holds only when every rank of the machine sent
the same files and the same tensors; every rank reaches the same verdict on whether a second agreement runs."""

from __future__ import annotations

import pytest

from tiersave import splitverify
from tiersave.errors import ConfigError


def doc(node: list[int], inode: int = 7, names: str = "abc") -> dict:
    return {"node": node, "files": {"0": [1, inode, 100, 5, 6]}, "names": names}


def test_a_split_holds_when_every_rank_of_the_machine_sent_the_same_document():
    docs = [doc([0, 1]), doc([0, 1]), doc([2, 3]), doc([2, 3])]
    assert all(splitverify.holds(docs, r) for r in range(4))
    assert not splitverify.fallback_needed(docs)


@pytest.mark.parametrize(
    "other",
    [doc([0, 1], inode=8), doc([0, 1], names="abd"), None, {"type": "X", "message": "m", "copy": True}],
    ids=["another inode", "other tensors read", "a rank that did not split", "a malformed document"],
)
def test_any_difference_on_the_machine_breaks_the_split_for_its_ranks_only(other):
    docs = [doc([0, 1]), other, doc([2, 3]), doc([2, 3])]
    assert not splitverify.holds(docs, 0)
    assert splitverify.holds(docs, 2) and splitverify.holds(docs, 3)  # the other machine is unaffected
    assert splitverify.fallback_needed(docs)  # and every rank, on either machine, sees that


def test_a_malformed_document_never_counts_as_a_held_split():
    assert not splitverify.holds([{"node": "0,1"}, doc([0, 1])], 0)
    assert not splitverify.holds([{"node": [0, 5]}, doc([0, 1])], 0)


def test_the_knob_turns_the_split_off_and_rejects_other_values(monkeypatch):
    assert splitverify.enabled()
    monkeypatch.setenv("TIERSAVE_SPLIT_VERIFY", "0")
    assert not splitverify.enabled()
    monkeypatch.setenv("TIERSAVE_SPLIT_VERIFY", "2")
    with pytest.raises(ConfigError, match="TIERSAVE_SPLIT_VERIFY"):
        splitverify.enabled()
