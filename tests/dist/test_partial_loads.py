"""Partial and transfer-learning restores in a collective Checkpointer (real processes, gloo on 127.0.0.1): each
rank restores its own subset of its own part, and reads only that subset's bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parent / "partial_workers.py"


def test_each_rank_restores_its_own_subset(launch, tmp_path):
    job = launch(
        "partial", 2, env={"TIERSAVE_TEST_ROOT": str(tmp_path / "ckpt"), "TIERSAVE_DIST_TIMEOUT": "20"}, script=SCRIPT
    )
    for r in range(2):
        rec = job.rank(r)
        assert "crash" not in rec, rec
        assert rec["subset_ok"], rec
        assert rec["subset_read"] == rec["subset_expected"], rec
        assert rec["body_ok"] and rec["mismatched"] == ["model.2.weight", "model.2.bias"], rec
        assert rec["tl_read"] == rec["tl_expected"], rec
