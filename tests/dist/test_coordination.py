"""The coordination layer on a real 3-rank gloo job: JSON exchanges, agreement, identities, and the
two-phase commit decision with its clean failures (a no vote, a failing commit callback, a wrong step, a
vote that is not JSON), each of which must leave the group usable.

One job plays the whole sequence (workers.py ``basic``); each test asserts one behaviour on its records."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from workers import UNICODE

pytestmark = pytest.mark.dist

WORLD = 3


@pytest.fixture(scope="module")
def job(launch: Callable[..., Any]) -> Any:
    result = launch("basic", WORLD, env={"TIERSAVE_DIST_TIMEOUT": "20"}, deadline_s=100)
    assert result.returncodes == [0] * WORLD, result.logs
    return result


def every(job: Any, key: str) -> list[Any]:
    return [job.rank(r)[key] for r in range(WORLD)]


def assert_same_failure(outcomes: list[dict[str, Any]], failing: dict[str, str]) -> None:
    """Every rank raised DistributedCheckpointError with the same text, naming exactly ``failing``
    (rank -> exception type)."""
    for outcome in outcomes:
        assert outcome["ok"] is False, outcome
        assert outcome["type"] == "DistributedCheckpointError"
        assert {r: f[0] for r, f in outcome["failures"].items()} == failing
    assert len({o["message"] for o in outcomes}) == 1, [o["message"] for o in outcomes]


def test_json_round_trips_unicode_large_and_empty(job: Any) -> None:
    assert job.rank(0)["gather"] is True  # rank 0 got every rank's ~300 KB unicode document intact
    assert every(job, "gather")[1:] == [None] * (WORLD - 1)
    assert every(job, "broadcast") == [{"emoji": "🚀", "n": [1, 2.5]}] * WORLD
    assert every(job, "all_gather_none") == [[None] * WORLD] * WORLD
    assert every(job, "all_gather_empty") == [[{}, "", {}]] * WORLD
    assert every(job, "all_gather_unicode") == [[f"{UNICODE}-{r}" for r in range(WORLD)]] * WORLD


def test_identity_and_nonces_agree(job: Any) -> None:
    nonces = every(job, "nonce")
    assert len(set(nonces)) == 1 and re.fullmatch(r"[0-9a-f]{16}", nonces[0])
    fresh = every(job, "new_nonce")
    assert len(set(fresh)) == 1 and fresh[0] != nonces[0]
    for r in range(WORLD):
        ident = job.rank(r)["identity"]
        assert (ident["rank"], ident["world_size"], ident["local_rank"]) == (r, WORLD, r)
        assert (ident["node_rank"], ident["num_nodes"], ident["local_world_size"]) == (0, 1, WORLD)


def test_agree_passes_on_equal_values_and_names_the_rank_that_differs(job: Any) -> None:
    assert all(o["ok"] for o in every(job, "agree_same"))
    outcomes = every(job, "agree_differs")
    assert_same_failure(outcomes, {"2": "ValueError"})
    assert "fingerprint of model.w" in outcomes[0]["message"] and "'xyz' on rank 2" in outcomes[0]["message"]


def test_all_yes_commits_once_on_rank_0_and_every_rank_sees_the_outcome(job: Any) -> None:
    outcomes = every(job, "vote_yes")
    expected = {"step": 10, "result": {"manifest": "step-1", "ranks": WORLD}, "world_size": WORLD}
    assert [o["value"] for o in outcomes] == [expected] * WORLD
    assert job.rank(0)["calls_after_yes"] == 1
    assert every(job, "calls_after_yes")[1:] == [0] * (WORLD - 1)  # never on the other ranks
    assert job.rank(0)["payloads_seen"] == [{"files": [f"rank{r}.bin"], "bytes": 1000 + r} for r in range(WORLD)]


def test_one_no_vote_fails_every_rank_naming_it_and_commit_never_runs(job: Any) -> None:
    outcomes = every(job, "vote_no")
    assert_same_failure(outcomes, {"1": "NoSpaceError"})
    assert "step 11" in outcomes[0]["message"] and "rank 1 voted no" in outcomes[0]["message"]
    assert "disk full on rank 1" in outcomes[0]["message"]
    assert job.rank(0)["calls_after_no"] == 1  # unchanged since the committed vote


def test_failing_commit_callback_fails_every_rank(job: Any) -> None:
    outcomes = every(job, "vote_commit_raises")
    assert_same_failure(outcomes, {"0": "OSError"})
    assert "vote/commit" in outcomes[0]["message"] and "global manifest write failed" in outcomes[0]["message"]
    assert job.rank(0)["calls_after_commit_raises"] == 2  # it ran (once) and raised


def test_vote_for_another_step_is_refused(job: Any) -> None:
    outcomes = every(job, "vote_other_step")
    assert_same_failure(outcomes, {"2": "ValueError"})
    assert "voted for step 14 while rank 0 voted for step 13" in outcomes[0]["message"]


def test_payload_that_is_not_json_fails_every_rank_naming_it(job: Any) -> None:
    outcomes = every(job, "vote_not_json")
    assert_same_failure(outcomes, {"1": "ConfigError"})
    assert "not JSON" in outcomes[0]["message"]
    assert job.rank(0)["calls_before_thread"] == 2  # neither the wrong step nor the bad payload committed


def test_vote_from_a_background_thread(job: Any) -> None:
    outcomes = every(job, "vote_thread")
    assert [o["value"]["result"] for o in outcomes] == [{"manifest": "step-3", "ranks": WORLD}] * WORLD


def test_clean_failures_leave_the_group_usable(job: Any) -> None:
    assert [o["value"]["step"] for o in every(job, "vote_last")] == [17] * WORLD
    assert job.rank(0)["calls_end"] == 4
    assert every(job, "poisoned") == [False] * WORLD
    assert all(t < 10 for t in every(job, "teardown_s"))


def test_one_rank_job_needs_no_messages(launch: Callable[..., Any]) -> None:
    solo = launch("solo", 1, deadline_s=60)
    assert solo.returncodes == [0], solo.logs
    rec = solo.rank(0)
    assert rec["identity"]["world_size"] == 1 and rec["all_gather"] == [{"k": UNICODE}]
    assert rec["agree"]["ok"] and rec["vote"]["value"]["result"] == {"payloads": [{"f": 1}]}
    assert rec["vote_no"]["failures"] == {"0": ["OSError", "EIO"]}


def test_ranks_making_different_calls_are_named_and_poison_the_group(job: Any) -> None:
    outcomes = every(job, "out_of_step")
    assert all(not o["ok"] and list(o["failures"]) in (["2"], ["0"]) for o in outcomes), outcomes
    assert "rank 2 made a different call (out of step)" in outcomes[0]["message"]
    assert "rank 2 is at call #" in outcomes[0]["message"] and "(agree)" in outcomes[0]["message"]
    assert outcomes[0]["message"] == outcomes[1]["message"]  # rank 1 learns it from rank 0
    assert "(vote)" in outcomes[2]["message"]  # rank 2 sees that rank 0's reply belongs to another call
    assert job.rank(0)["calls_out_of_step"] == 4  # nothing committed
    assert every(job, "poisoned_at_end") == [True] * WORLD
