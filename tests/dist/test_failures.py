"""Communication failures on real gloo jobs: a rank that hangs, a rank SIGKILLed before voting, a dead
coordinator. Nobody hangs: the others raise DistributedCheckpointError within the timeout (plus a margin for
a loaded machine), naming the rank, and the group is poisoned afterwards. Also: two simulated nodes under
torchrun report their node identity."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.dist

TIMEOUT_S = 3.0
MARGIN_S = 6.0  # scheduling slack on 2 shared cores; the bound still proves "no hang"


def assert_clean_exit(job: Any, ranks: list[int]) -> None:
    """These ranks exited 0 and destroy_process_group() returned promptly, poisoned group or not."""
    for r in ranks:
        assert job.returncodes[r] == 0, job.logs
        assert job.rank(r)["teardown_s"] < MARGIN_S


def test_hung_rank_is_named_on_every_other_rank_within_the_timeout(launch: Callable[..., Any]) -> None:
    job = launch("hang", 3, env={"TIERSAVE_DIST_TIMEOUT": str(TIMEOUT_S), "TIERSAVE_DIST_VICTIM": "2"})
    survivors = [job.rank(0)["vote"], job.rank(1)["vote"]]
    for outcome in survivors:
        assert outcome["ok"] is False
        assert outcome["failures"] == {
            "2": ["TimeoutError", "rank 2 sent nothing within 3 s (hung, dead, or not calling vote)"]
        }
        assert "step 3" in outcome["message"] and "unusable" in outcome["message"]
        assert TIMEOUT_S * 0.9 <= outcome["elapsed"] <= TIMEOUT_S + MARGIN_S
    assert survivors[0]["message"] == survivors[1]["message"]
    for r in (0, 1):
        later = job.rank(r)["later"]  # poisoned: the next call raises at once, with the first failure in it
        assert later["ok"] is False and later["elapsed"] < 0.5
        assert "unusable" in later["message"] and "rank 2 sent nothing" in later["message"]
        assert job.rank(r)["poisoned"] is True
    # The sleeper wakes after everyone gave up: it raises too (rank 0's failure notice or a closed connection).
    assert job.rank(2)["vote"]["ok"] is False and job.rank(2)["poisoned"] is True
    assert_clean_exit(job, [0, 1, 2])


def test_hung_coordinator_is_named_after_the_reply_deadline(launch: Callable[..., Any]) -> None:
    # Followers wait timeout_s (rank 0's gathering) plus the commit allowance (default: timeout_s again).
    job = launch("hang", 2, env={"TIERSAVE_DIST_TIMEOUT": "2", "TIERSAVE_DIST_VICTIM": "0"})
    outcome = job.rank(1)["vote"]
    assert outcome["ok"] is False and list(outcome["failures"]) == ["0"]
    assert outcome["failures"]["0"][0] == "TimeoutError"
    assert "no answer from rank 0 within 4 s" in outcome["message"]
    assert 4 * 0.9 <= outcome["elapsed"] <= 4 + MARGIN_S
    assert job.rank(1)["later"]["ok"] is False and job.rank(1)["poisoned"] is True
    assert_clean_exit(job, [0, 1])


def test_rank_sigkilled_before_voting_fails_the_survivors_within_the_timeout(launch: Callable[..., Any]) -> None:
    job = launch("killed", 3, env={"TIERSAVE_DIST_TIMEOUT": str(TIMEOUT_S), "TIERSAVE_DIST_VICTIM": "2"})
    assert job.returncodes[2] == -signal.SIGKILL
    assert 2 not in job.records
    for r in (0, 1):
        outcome = job.rank(r)["vote"]
        assert outcome["ok"] is False and list(outcome["failures"]) == ["2"]
        assert outcome["elapsed"] <= TIMEOUT_S + MARGIN_S
        assert job.rank(r)["poisoned"] is True
    assert_clean_exit(job, [0, 1])


def test_dead_coordinator_fails_the_others_at_once(launch: Callable[..., Any]) -> None:
    job = launch("killed", 3, env={"TIERSAVE_DIST_TIMEOUT": str(TIMEOUT_S), "TIERSAVE_DIST_VICTIM": "0"})
    assert job.returncodes[0] == -signal.SIGKILL
    for r in (1, 2):
        outcome = job.rank(r)["vote"]
        assert outcome["ok"] is False and list(outcome["failures"]) == ["0"]
        assert outcome["failures"]["0"][0] == "ConnectionError"  # the closed connection, not a timeout
        assert "rank 0 unreachable during vote" in outcome["message"]
        assert outcome["elapsed"] < TIMEOUT_S
    assert_clean_exit(job, [1, 2])


def test_two_torchrun_nodes_report_their_node_identity(launch_torchrun: Callable[..., Any]) -> None:
    job = launch_torchrun("nodes", nnodes=2, nproc_per_node=2)
    assert job.returncodes == [0, 0], job.logs
    table = job.rank(0)["identities"]
    for r in range(4):
        rec = job.rank(r)
        node, local = int(rec["env"]["GROUP_RANK"]), int(rec["env"]["LOCAL_RANK"])
        assert rec["identity"] == table[r]  # every rank holds the same table
        assert (rec["identity"]["node_rank"], rec["identity"]["local_rank"]) == (node, local)
        assert (rec["identity"]["num_nodes"], rec["identity"]["local_world_size"]) == (2, 2)
        assert rec["vote"]["value"]["result"] == 4
    assert sorted((i["node_rank"], i["local_rank"]) for i in table) == [(0, 0), (0, 1), (1, 0), (1, 1)]
