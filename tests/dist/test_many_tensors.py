"""Many ranks x many tensors end to end (real gloo processes): 4 ranks of 20,000 tensors each save, save
asynchronously and restore bit-exactly through one compact global manifest; a global manifest over the cap
fails every rank's save, naming the tensor count and the cap, before anything is committed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tiersave.catalog import Catalog
from tiersave.format.layout import MANIFEST_NAME, step_dirname
from tiersave.storage.posix import LocalStorage

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parent / "many_workers.py"


def test_four_ranks_of_20000_tensors_round_trip_through_a_compact_manifest(launch, tmp_path):
    root = tmp_path / "ckpt"
    env = {"TIERSAVE_TEST_ROOT": str(root), "TIERSAVE_TEST_TENSORS": "20000", "TIERSAVE_DIST_TIMEOUT": "240"}
    job = launch("many_round_trip", 4, env=env, script=SCRIPT, deadline_s=900)
    for r in range(4):
        rec = job.rank(r)
        assert "crash" not in rec, (rec, job.logs)
        assert rec["async_step"] == 2 and rec["restored_2"] and rec["restored_1"], rec
        assert rec["tensors"] >= 20_000
    assert set(job.rank(0)["vote"]) >= {"gather_s", "merge_s", "encode_s", "write_s", "manifest_bytes"}
    assert "wait_s" in job.rank(1)["vote"]
    doc = json.loads((root / step_dirname(2) / MANIFEST_NAME).read_bytes())
    assert doc["format_version"].startswith("4.") and "table" in doc and "tensors" not in doc
    assert doc["world_size"] == 4
    own = sum(job.rank(r)["flat"] - 8 for r in range(4))
    assert len(doc["table"]["shard"]) == own + 8  # every rank's own tensors, the 8 replicated ones once
    report = Catalog(LocalStorage(root)).verify(2)
    assert report.ok, report.errors


def test_a_global_manifest_over_the_cap_fails_every_rank_before_the_commit(launch, tmp_path):
    root = tmp_path / "ckpt"
    cap = 256 << 10
    env = {
        "TIERSAVE_TEST_ROOT": str(root),
        "TIERSAVE_TEST_TENSORS": "3000",
        "TIERSAVE_TEST_CAP": str(cap),
        "TIERSAVE_DIST_TIMEOUT": "120",
    }
    job = launch("over_the_cap", 4, env=env, script=SCRIPT, deadline_s=600)
    for r in range(4):
        rec = job.rank(r)
        assert "crash" not in rec, (rec, job.logs)
        assert rec["save1"]["type"] == "DistributedCheckpointError", rec
        assert rec["rank0_error"]["type"] == "FormatError", rec
        message = rec["rank0_error"]["message"]
        counted = re.search(r"of 4 ranks and (\d+) tensors would exceed the (\d+)-byte cap", message)
        assert counted and int(counted[1]) > 11_900 and int(counted[2]) == cap, message
        assert rec["latest"] is None and rec["after"] == 2
        assert not [e for e in rec["entries"] if e.startswith("step-1")], rec["entries"]
    assert Catalog(LocalStorage(root)).steps() == [2]


def test_a_forged_row_of_another_rank_makes_every_rank_refuse_the_copy(launch, tmp_path):
    """Each rank parses only its view of the global manifest (its rows, its subtree), but the table is checked
    whole: rank 1 refuses a resealed manifest whose forged row is rank 0's, and both restore step 1."""
    env = {
        "TIERSAVE_TEST_ROOT": str(tmp_path / "ckpt"),
        "TIERSAVE_TEST_TENSORS": "6000",
        "TIERSAVE_DIST_TIMEOUT": "120",
    }
    job = launch("forged_row", 2, env=env, script=SCRIPT, deadline_s=600)
    forged = job.rank(0).get("forged", "")
    assert forged.startswith("rank-00000/model.") and job.rank(0)["format_version"].startswith("4."), job.rank(0)
    for r in range(2):
        rec = job.rank(r)
        assert "crash" not in rec, (rec, job.logs)
        assert rec["restored_1"] and rec["report_step"] == 1, rec
        assert [s for s, _ in rec["skipped"]] == [2], rec
    assert forged in job.rank(1)["skipped"][0][1], job.rank(1)  # rank 1 found rank 0's row out of range itself
