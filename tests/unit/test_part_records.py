"""The "part durable" records of part drains (partdrain.py), read the way rank 0 reads them: from a real local
tier, and never trusted: whatever is malformed is that node's error, naming the record."""

from __future__ import annotations

import json

import pytest

from tiersave.partdrain import read_record, record_name
from tiersave.storage.posix import LocalStorage

PREFIX = "step-0000000004.tmp-1-00000000-0000000000000000"


@pytest.fixture
def tier(tmp_path):
    return LocalStorage(tmp_path / "tier")


def put(tier: LocalStorage, node: int, data: bytes) -> None:
    tier.put(f"{PREFIX}/{record_name(node)}", data, mode="create")


def test_a_good_record_gives_the_shards_and_an_absent_one_none(tier):
    assert read_record(tier, PREFIX, 1, 4) is None
    put(tier, 1, json.dumps({"node": 1, "step": 4, "shards": {"shard-00001-000.bin": 8192}}).encode())
    assert read_record(tier, PREFIX, 1, 4) == {"shard-00001-000.bin": 8192}


def test_an_error_record_gives_the_nodes_reason(tier):
    put(tier, 2, json.dumps({"node": 2, "step": 4, "error": "checksum mismatch in mem://run"}).encode())
    assert read_record(tier, PREFIX, 2, 4) == "checksum mismatch in mem://run"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x80not json", "is not JSON"),
        (b"[1, 2]", "is not node 1's record of step 4"),
        (json.dumps({"node": 3, "step": 4, "shards": {}}).encode(), "is not node 1's record of step 4"),
        (json.dumps({"node": 1, "step": 5, "shards": {}}).encode(), "is not node 1's record of step 4"),
        (json.dumps({"node": 1, "step": 4}).encode(), "lists no valid shards"),
        (json.dumps({"node": 1, "step": 4, "shards": {"a": True}}).encode(), "lists no valid shards"),
        (json.dumps({"node": 1, "step": 4, "shards": {"a": -1}}).encode(), "lists no valid shards"),
        (json.dumps({"node": 1, "step": 4, "shards": ["a"]}).encode(), "lists no valid shards"),
        (b" " * (2 << 20), "is unreadable"),
    ],
)
def test_a_malformed_record_is_that_nodes_error_naming_it(tier, data, why):
    put(tier, 1, data)
    reason = read_record(tier, PREFIX, 1, 4)
    assert isinstance(reason, str) and why in reason and record_name(1) in reason, reason
