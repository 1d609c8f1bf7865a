"""`tiersave stats` reports the bytes a run did not write: shards referenced by incremental saves instead of
written again, and the shrinking of compressed drains, from the run's own event log."""

from __future__ import annotations

import json

import pytest
import torch

import tiersave
from tiersave.cli import main

pytest.importorskip("zstandard")


def test_stats_sums_what_incremental_saves_and_compressed_drains_did_not_write(tmp_path, capsys):
    root, slow = tmp_path / "fast", tmp_path / "slow"
    state = {"frozen": torch.zeros(4 << 20), "adapter": torch.randn(1000)}  # 16 MiB frozen, 4 KB trained
    with tiersave.Checkpointer(
        tiers=[tiersave.Tier(root), tiersave.Tier(slow, name="slow", compress="zstd")], incremental=True
    ) as c:
        for step in (1, 2, 3):
            state["adapter"] += 1
            c.save(step, state)
        c.wait()
    assert main(["stats", str(root), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    inc = summary["incremental"]
    assert inc["saves"] == 3 and inc["referenced_bytes"] >= 2 * (16 << 20)  # saves 2 and 3 reference the frozen
    assert inc["referenced_bytes"] < inc["bytes"]
    [(tier, drains)] = summary["drains"].items()
    # fast saves outrun the drain, which then sends the newest (catch-up): at least the first and the last
    assert drains["drains"] >= 2 and drains["file_bytes"] < drains["bytes"] // 10  # zeros compress
    assert main(["stats", str(root)]) == 0
    text = capsys.readouterr().out
    assert "incremental: 3 saves wrote" in text and "referenced, not written again" in text
    assert f"tier {tier}: {drains['drains']} drains stored" in text


def test_stats_reports_what_incremental_drains_referenced_instead_of_copying(tmp_path, capsys):
    root, slow = tmp_path / "fast", tmp_path / "slow"
    state = {"frozen": torch.zeros(4 << 20), "adapter": torch.randn(1000)}  # 16 MiB frozen, 4 KB trained
    with tiersave.Checkpointer(
        tiers=[tiersave.Tier(root), tiersave.Tier(slow, name="slow", incremental=True)], incremental=True
    ) as c:
        for step in (1, 2, 3):
            state["adapter"] += 1
            c.save(step, state).tiers["slow"].result(60)  # each step drained, against the one before
    assert main(["stats", str(root), "--json"]) == 0
    drains = json.loads(capsys.readouterr().out)["summary"]["drains"]["slow"]
    assert drains["drains"] == 3
    assert drains["referenced_bytes"] >= 2 * (16 << 20)  # steps 2 and 3 reference step 1's frozen shard
    assert drains["file_bytes"] < (16 << 20) + (1 << 20)  # the frozen shard was copied once
    assert main(["stats", str(root)]) == 0
    text = capsys.readouterr().out
    assert "tier slow: 3 drains stored" in text and "referenced, not copied again" in text
