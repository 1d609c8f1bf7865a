"""Large tensors staged from the address read once per save (no torch call per unit on the staging thread).

A blocking save copies each chunk of a plain host tensor straight from its address; tensors that are not
plain (non-contiguous, conj/neg bits, views at a storage offset, units wrapping a ring smaller than the
save) must still arrive bit-exact, and a save must not see changes made after it returned.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tiersave import Checkpointer

MiB = 1 << 20


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(3 * MiB // 4 + 123, generator=g)
    return {
        "plain": torch.randn(2 * MiB // 4 + 5, generator=g),  # > 1 MiB: its own units; tail off the 4 KiB grid
        "offset_view": base[1000:],  # a storage offset: the address includes it
        "strided": torch.randn(1024, 1024, generator=g).t(),  # not contiguous: copied through torch
        "neg": torch.randn(2 * MiB // 8, dtype=torch.complex64, generator=g).conj(),
        "bf16": torch.randn(3 * MiB // 2, generator=g).to(torch.bfloat16),
        "small": torch.arange(10),
    }


def _expect(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.resolve_conj().clone() for k, v in state.items()}


def _check(out: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(out) == set(want)
    for name, t in want.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert torch.equal(out[name].resolve_conj(), t), name


def test_blocking_save_of_large_tensors_is_bit_exact_on_every_staging_path(tmp_path: Path) -> None:
    state = _state()
    want = _expect(state)
    # chunk 1 MiB: multi-chunk tensors; a 3 MiB ring smaller than the save: units wrap around the arena
    for staging in (None, 3 * MiB):
        with Checkpointer(tmp_path / str(staging), chunk_bytes=MiB, staging_bytes=staging, event_log=False) as ck:
            ck.save(1, state)
            _check(ck.restore(1), want)


def test_state_larger_than_the_ring_is_isolated_once_save_returns(tmp_path: Path) -> None:
    # A non-blocking save of a state larger than its staging ring streams through the ring on the caller's
    # thread (the per-unit path), so when it returns every byte is staged: later changes must not be saved.
    state = _state()
    want = _expect(state)
    with Checkpointer(tmp_path, chunk_bytes=MiB, staging_bytes=3 * MiB, event_log=False) as ck:
        handle = ck.save(1, state, blocking=False)
        for t in state.values():
            if t.is_floating_point():
                t.add_(1)
        handle.result(timeout=60)
        _check(ck.restore(1), want)
