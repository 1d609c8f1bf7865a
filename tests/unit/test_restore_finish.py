"""A restore's read of one copy loads the live state once: ``Restore.finish()`` may be called again (a restore
that loaded before the ranks' agreement, then ``finish_together``) and returns the first call's result, the
live state untouched by the second call."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.restore import Restore
from tiersave.storage.posix import LocalStorage


class Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1000))
        self.loads = 0

    def load_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.loads += 1
        return super().load_state_dict(*args, **kwargs)


def test_finish_loads_once_and_a_second_call_returns_the_first_result(tmp_path: Path) -> None:
    saved = Counting()
    with torch.no_grad():
        saved.w.copy_(torch.arange(1000.0))
    with tiersave.Checkpointer(tmp_path, event_log=False, handle_sigterm=False) as ckpt:
        ckpt.save(3, {"model": saved})
    live = {"model": Counting()}
    with ThreadPoolExecutor(2) as pool, Catalog(LocalStorage(tmp_path)).open(3) as opened:
        job = Restore(opened, live, True)
        job.read(pool)
        first = job.finish()
        assert live["model"].loads == 1 and torch.equal(live["model"].w, saved.w)
        with torch.no_grad():
            live["model"].w.zero_()  # what training does next: a second finish must not load again
        assert job.finish() is first
    assert live["model"].loads == 1 and not live["model"].w.any()
