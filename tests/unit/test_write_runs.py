"""Runs of expert-sized tensors are written with one request per run (engine/pipeline.py ``_Runs``).

A state of many tensors between 1 MiB and a chunk (an MoE model's experts) used to cost one write request per
tensor; consecutive ones are now gathered into requests of up to ``chunk_bytes``. The files and checksums must
be those of a save written tensor by tensor, every save path must still round-trip bit-exact, and a failed
run must leave nothing.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from tiersave import Checkpointer
from tiersave.errors import StorageError
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import Fault, FaultyStorage

MiB = 1 << 20


def _experts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(15)
    state = {f"layers.0.experts.{i}.w": torch.randn((3 * MiB // 2 + 5 * i) // 4, generator=g) for i in range(12)}
    state["norm"] = torch.randn(100, generator=g)  # a small tensor between runs: a group, which closes a run
    state.update({f"layers.1.experts.{i}.w": torch.randn(2 * MiB // 4, generator=g) for i in range(5)})
    state["big"] = torch.randn(9 * MiB // 4, generator=g)  # larger than a chunk: its own units
    return state


def _files(root: Path) -> dict[str, bytes]:
    step = next(p for p in root.iterdir() if p.name.startswith("step-"))
    return {p.name: p.read_bytes() for p in sorted(step.iterdir()) if p.name != "manifest.json"}


@pytest.mark.parametrize("blocking", [True, False])
def test_runs_write_the_same_bytes_with_fewer_requests(tmp_path: Path, blocking: bool) -> None:
    state = _experts()
    runs = tmp_path / "runs"
    with Checkpointer(LocalStorage(runs, io="direct"), chunk_bytes=8 * MiB, event_log=False) as ck:
        ck.save(1, state, blocking=blocking).result()
        requests = ck._saver.storage.io_stats.to_json()["paths"]
        out = ck.restore(1)
        assert all(torch.equal(out[k], v) for k, v in state.items())
        entries = {k: t.crc32c for k, t in ck.catalog.manifest(1).tensors.items()}
    # 17 experts in runs of at most 8 MiB (5 + 4 + 3 + 4 ...), not 17 requests; "big" in 2 chunks
    calls = sum(p["calls"] for name, p in requests.items() if name.startswith("direct"))
    assert 2 <= calls <= 10, requests  # at least "big"'s two chunks went direct: the runs were measured
    # the reference: the unstaged buffered save writes each tensor where it lies, one by one
    plain = tmp_path / "plain"
    with Checkpointer(LocalStorage(plain, io="buffered"), chunk_bytes=8 * MiB, event_log=False) as ck:
        assert ck.save(1, state).stats.extra.get("unstaged") is True
        assert {k: t.crc32c for k, t in ck.catalog.manifest(1).tensors.items()} == entries
    assert _files(runs) == _files(plain)


def test_a_failed_run_leaves_nothing(tmp_path: Path) -> None:
    broken = FaultyStorage(
        LocalStorage(tmp_path, io="direct"), [Fault("write_at", nth=2, error=lambda: OSError(errno.EIO, "bad"))]
    )
    with Checkpointer(broken, chunk_bytes=8 * MiB, event_log=False) as ck:
        with pytest.raises(StorageError, match="bad"):
            ck.save(1, _experts())
        assert ck.list() == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("step-")]
