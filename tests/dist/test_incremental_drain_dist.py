"""Incremental drains of a collective checkpoint (real multi-process jobs, gloo on 127.0.0.1): rank 0 drains
the global manifest to an incremental later tier, which references every rank's unchanged shards; every rank
restores every step from that tier alone, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiersave.catalog import Catalog
from tiersave.storage.posix import LocalStorage

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parent / "drain_refs_workers.py"
FROZEN_BYTES = 9 << 20  # each rank's frozen base (incremental_workers.lora)


def test_collective_drain_references_every_ranks_frozen_shard(launch, tmp_path):
    world = 2
    second = tmp_path / "second"
    env = {
        "TIERSAVE_TEST_ROOT": str(tmp_path / "first"),
        "TIERSAVE_DIST_TIMEOUT": "8",
        "STEPS": "1,2,3",
        "SECOND": str(second),
    }
    job = launch("drain_chain", world, env=env, script=SCRIPT, deadline_s=180)
    for r in range(world):
        rec = job.rank(r)
        assert "crash" not in rec, rec
        assert rec["kept"] == [1, 2, 3]
        assert rec["restored"] == {"1": True, "2": True, "3": True}, (r, rec)
    catalog = Catalog(LocalStorage(second))
    for step in (2, 3):
        m = catalog.manifest(step)
        assert m.referenced_steps == {1}
        assert m.referenced_bytes == world * FROZEN_BYTES
        assert {s.rank for s in m.shards if s.is_reference} == set(range(world))
