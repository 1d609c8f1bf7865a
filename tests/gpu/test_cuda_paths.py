"""CUDA paths: pinned staging with non-blocking copies on a side stream, snapshot consistency against
kernels queued right after save_async, and restore into CUDA tensors. Run only where a GPU exists."""

from __future__ import annotations

import pytest
import torch

import tiersave
from helpers import assert_same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_save_async_of_cuda_tensors_is_a_consistent_snapshot(root):
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 1 << 16, device="cuda"), "b": torch.randn(1000, device="cuda", dtype=torch.bfloat16)}
    expected = {k: v.cpu() for k, v in state.items()}
    with tiersave.Checkpointer(root) as ckpt:
        handle = ckpt.save_async(1, state)
        state["w"].mul_(0).add_(5)  # queued on the current stream right after the call
        state["b"].fill_(1)
        handle.result(60)
        assert ckpt._saver.arena.pinned
        restored = ckpt.restore(1)
    assert_same(restored, expected)


def test_restore_into_a_cuda_model(root):
    model = torch.nn.Linear(256, 128).cuda()
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    optim.step()
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": model, "optim": optim})
        fresh = torch.nn.Linear(256, 128).cuda()
        fresh_optim = torch.optim.Adam(fresh.parameters())
        ckpt.restore(into={"model": fresh, "optim": fresh_optim})
    assert torch.equal(fresh.weight, model.weight) and fresh.weight.device.type == "cuda"
    assert_same(optim.state_dict(), fresh_optim.state_dict())


def test_lazy_save_of_a_cuda_model_holds_the_values_before_the_next_step(root):
    """The lazy snapshot's device path: copies on a side stream that waited for the caller's stream; the guarded
    Adam's step (on the caller's stream) waits for them; BatchNorm's forward waits for its buffers' copies."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 8)).cuda()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(64, 512, device="cuda")

    def train_step():
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()

    train_step()
    with tiersave.Checkpointer(root, guard=[optim, model]) as ckpt:
        expected = {k: v.cpu() for k, v in model.state_dict().items()}
        handle = ckpt.save_async(1, {"model": model, "optim": optim}, lazy=True)
        train_step()  # queued at once: the hooks order it after the copies
        handle.result(60)
        restored = ckpt.restore(1)
    assert_same(restored["model"], expected)
