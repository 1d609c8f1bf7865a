"""The message format of the coordination layer, in one process: JSON encoding (never pickle), the header's
check word, and rebuilding remote errors only from a fixed table of types."""

from __future__ import annotations

import math

import pytest

from tiersave.dist.wire import (
    Header,
    RemoteRankError,
    decode_json,
    encode_json,
    error_from_report,
    failure_error,
    failure_report,
    report_error,
)
from tiersave.errors import DistributedCheckpointError, NoSpaceError


@pytest.mark.parametrize(
    "doc",
    [None, "", {}, [], 0, -1, 2**62, 1.5, True, "π ✓ 日本語 🚀 \u0000", {"a": [1, {"b": None}]}, "x" * 1_000_000],
)
def test_json_round_trip(doc: object) -> None:
    assert decode_json(encode_json(doc)) == doc  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.nan, math.inf, {1, 2}, b"bytes", object()])
def test_non_json_is_refused(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        encode_json({"v": bad})  # type: ignore[dict-item]


def test_header_round_trip_and_rejects_partial_or_foreign_words() -> None:
    header = Header.for_payload(seq=5, op=6, step=120, payload=b"hello")
    words = header.words()
    assert Header.parse(words) == header
    for i in range(len(words)):
        torn = list(words)
        torn[i] = 0  # what a header still arriving looks like in a zeroed buffer
        assert Header.parse(torn) is None
    assert Header.parse([0] * len(words)) is None
    assert Header.for_payload(seq=1, op=1, step=None, payload=b"").step == -1


def test_remote_errors_are_rebuilt_only_from_known_types() -> None:
    assert isinstance(error_from_report(1, report_error(NoSpaceError("full"))), NoSpaceError)
    assert isinstance(error_from_report(1, report_error(TimeoutError("slow"))), TimeoutError)
    other = error_from_report(2, {"type": "os.system", "message": "rm -rf /"})
    assert isinstance(other, RemoteRankError) and other.rank == 2 and other.type_name == "os.system"
    assert str(other) == "os.system: rm -rf /"
    clipped = report_error(ValueError("y" * 100_000))["message"]
    assert isinstance(clipped, str) and len(clipped) <= 4000


def test_failure_report_gives_the_same_error_text_with_ranks_and_step() -> None:
    report = failure_report(
        op="vote",
        phase="decide",
        step=7,
        summary="rank 3 voted no (NoSpaceError)",
        failures={3: report_error(NoSpaceError("disk full"))},
        poison=False,
    )
    err = failure_error(report)
    assert isinstance(err, DistributedCheckpointError) and set(err.failures) == {3}
    assert str(err) == str(failure_error(report))
    assert "step 7" in str(err) and "vote/decide" in str(err) and "rank 3: NoSpaceError: disk full" in str(err)
    assert "unusable" not in str(err)
    assert "unusable" in str(failure_error({**report, "poison": True}))
