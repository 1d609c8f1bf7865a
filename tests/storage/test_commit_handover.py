"""An attempt handed over to another process (a node's part of a node-by-node drain, committed or removed by
rank 0) is no longer one of this process's live attempts."""

from __future__ import annotations

from tiersave.commit import MarkerCommit
from tiersave.storage.posix.local import LocalStorage


def test_an_attempt_handed_over_to_another_process_is_no_longer_counted_live_here(tmp_path):
    storage = LocalStorage(str(tmp_path / "root"))
    commit = MarkerCommit(storage)  # the object-store protocol; a file system offers the create-only put too
    prefix = commit.begin(9)
    storage.put(f"{prefix}/shard-00000-00000.bin", b"\0" * 4096)
    kinds = {item.prefix: item.status for item in commit.leftovers()}
    assert kinds == {prefix: "live"}
    commit.hand_over(prefix)  # otherwise every drain would leave one record in this process for good
    kinds = {item.prefix: item.status for item in commit.leftovers()}
    assert kinds == {prefix: "dead"}
    commit.abort(prefix)
    assert commit.leftovers() == []
