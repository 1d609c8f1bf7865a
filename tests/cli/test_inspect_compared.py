"""An incremental save reports the bytes it found unchanged by comparing them with the staging memory (never
hashed): in its statistics (the handle, the manifest's ``stats``, the event log) and in ``tiersave inspect``,
beside the bytes written and referenced."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import torch

import tiersave
from tiersave.cli import main as cli_main


def inspect(*args: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["inspect", *args]) == 0
    return out.getvalue()


def test_compared_bytes_are_reported_by_the_save_and_by_inspect(tmp_path):
    state = {"frozen": torch.randn(1 << 20), "adapter": torch.zeros(4096)}
    with tiersave.Checkpointer(tmp_path, incremental=True) as ckpt:
        first = ckpt.save(1, state)
        first.result()
        state["adapter"] += 1
        second = ckpt.save(2, state)
        second.result()
    assert first.stats.extra["compared_bytes"] == 0  # nothing to compare with: every piece hashed
    compared = second.stats.extra["compared_bytes"]
    assert compared >= 4 << 20, second.stats.extra  # the frozen tensor, unchanged in the staging memory
    data = json.loads(inspect(str(tmp_path), "--step", "2", "--json"))
    assert data["compared_bytes"] == compared == data["stats"]["compared_bytes"]
    assert "found unchanged in memory instead" in inspect(str(tmp_path), "--step", "2")
    events = [json.loads(line) for line in (tmp_path / "tiersave-events.jsonl").read_text().splitlines()]
    assert [e.get("compared_bytes") for e in events if e.get("outcome") == "committed"] == [0, compared]
