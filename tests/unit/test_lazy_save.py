"""The lazy snapshot (``save_async(..., lazy=True)`` with ``ckpt.guard(...)``): the snapshot-isolation tests of an
eager save, run lazily with every change made through a guarded optimizer or module; a hook that really waits;
unguarded tensors copied before the call returns; bounded waits; bad requests refused; background failures
reported. The background staging is held back by a gate so the changes land while it is pending."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import tiersave
from helpers import assert_same
from tiersave.engine import phased
from tiersave.errors import ConfigError, SaveTimeoutError


@pytest.fixture
def gate(monkeypatch):
    """Holds every background phase of a lazy save until set (at most 60 s, so a failing test cannot hang)."""
    event = threading.Event()
    real = phased.PhasedStaging.stage

    def gated(self, phase, after=None):
        if phase > 0:
            assert event.wait(60), "the test never opened the gate"
        return real(self, phase, after)

    monkeypatch.setattr(phased.PhasedStaging, "stage", gated)
    yield event
    event.set()


def run_in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


class Params(torch.nn.Module):
    """The tensors of the eager snapshot-isolation tests as parameters, so that an optimizer changes them."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(t) for t in tensors])


def sgd_moving_by(params: Params, delta: float) -> torch.optim.Optimizer:
    """An SGD whose every step adds ``delta`` to each parameter, in place."""
    for p in params.ps:
        p.grad = torch.full_like(p, -delta)
    return torch.optim.SGD(params.parameters(), lr=1.0)


@pytest.mark.parametrize("lazy", [False, True])
def test_changes_by_optimizer_step_after_save_async_never_leak_into_the_checkpoint(root, lazy, gate):
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(131072, generator=g) for _ in range(8)]
    tensors += [torch.randn(300, 200, generator=g).t(), torch.randn(1000, generator=g).to(torch.bfloat16)]
    params = Params(tensors)  # large, non-contiguous and bfloat16 tensors
    optim = sgd_moving_by(params, 7.0)
    state = {"model": params, "np": np.arange(5000, dtype=np.float64), "step": 1}
    expected = {k: v.clone() for k, v in params.state_dict().items()}
    with tiersave.Checkpointer(root, guard=optim) as ckpt:
        handle = ckpt.save_async(1, state, lazy=lazy)
        assert handle.staged() is not lazy  # lazy: the guarded tensors are not copied yet
        stepper, out = run_in_thread(optim.step)  # training goes on at once
        # lazy: held 1 s, so a stepper thread that reaches the guard late still waits well over 0.2 s;
        # eager: nothing holds the step, however loaded the machine
        stepper.join(1.0 if lazy else 30)
        assert stepper.is_alive() is lazy  # lazy: step() waits for the staging of what it changes
        state["np"][:] = -1  # not guarded: copied before save_async returned
        gate.set()
        stepper.join(30)
        assert not stepper.is_alive() and "error" not in out
        assert torch.equal(params.ps[0].detach(), expected["ps.0"] + 7.0)  # the step did happen
        handle.result(timeout=60)
        restored = ckpt.restore(1)
    assert_same(restored["model"], expected)
    assert np.array_equal(restored["np"], np.arange(5000, dtype=np.float64))
    if lazy:
        assert ckpt._saver.guard.waits == 1 and ckpt._saver.guard.waited_s > 0.2
        assert handle.stats.extra["lazy"]["lazy_bytes"] == sum(t.nbytes for t in expected.values())


def test_many_small_guarded_tensors_stay_as_saved(root, gate):
    params = Params([torch.full((256,), float(i)) for i in range(5000)])  # staged in groups of small tensors
    optim = sgd_moving_by(params, 1000.0)
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.guard(optim)
        handle = ckpt.save_async(1, {"model": params}, lazy=True)
        gate.set()
        optim.step()
        handle.result(timeout=120)
        restored = ckpt.restore(1)["model"]
    for i in range(5000):
        assert torch.equal(restored[f"ps.{i}"], torch.full((256,), float(i))), i


def test_adam_step_and_batchnorm_forward_right_after_save_async_wait_for_their_tensors(root, gate):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)

    def train_step():
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()

    train_step()
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.guard(optim, model)
        expected_model = {k: v.clone() for k, v in model.state_dict().items()}
        expected_optim = {k: v.clone() for k, v in optim.state[model[0].weight].items()}
        handle = ckpt.save_async(1, {"model": model, "optim": optim}, lazy=True)
        forward, out = run_in_thread(train_step)  # BatchNorm's forward changes its running statistics in place
        forward.join(0.3)
        assert forward.is_alive() and not handle.staged()
        gate.set()
        forward.join(30)
        assert "error" not in out
        handle.result(60)
        assert not torch.equal(model[1].running_mean, expected_model["1.running_mean"])  # changed after staging
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
        fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.1)
        ckpt.restore(1, into={"model": fresh, "optim": fresh_optim})
    assert_same(fresh.state_dict(), expected_model)
    assert_same(dict(fresh_optim.state[fresh[0].weight]), expected_optim)


def test_unguarded_tensors_are_copied_before_save_async_returns(root, gate):
    model = torch.nn.Linear(32, 32)
    model.weight.requires_grad_(False)  # frozen: no guarded optimizer changes it, so nothing would wait for it
    optim = torch.optim.SGD([model.bias], lr=1.0)
    extra = torch.arange(1000.0)  # a tensor the guard knows nothing of
    state = {"model": model, "optim": optim, "extra": extra}
    expected = {"weight": model.weight.clone(), "extra": extra.clone()}
    with tiersave.Checkpointer(root, guard=[optim, model]) as ckpt:
        handle = ckpt.save_async(1, state, lazy=True)
        assert handle.stats.extra["lazy"]["eager_bytes"] == 32 * 32 * 4 + 1000 * 4
        with torch.no_grad():
            model.weight.fill_(-1)  # outside every hook: harmless for the tensors copied at once
        extra.fill_(-1)
        gate.set()
        handle.result(60)
        restored = ckpt.restore(1)
    assert torch.equal(restored["model"]["weight"], expected["weight"])
    assert torch.equal(restored["extra"], expected["extra"])


def test_a_hook_waits_at_most_timeout_s_then_raises_naming_the_step(root, gate):
    params = Params([torch.zeros(1000)])
    optim = sgd_moving_by(params, 1.0)
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.guard(optim, timeout_s=0.2)
        handle = ckpt.save_async(4, {"model": params}, lazy=True)
        with pytest.raises(SaveTimeoutError, match=r"SGD.step\(\) waited 0.2 s for the lazy save of step 4"):
            optim.step()
        assert torch.equal(params.ps[0].detach(), torch.zeros(1000))  # the step did not run
        gate.set()
        handle.result(60)
        optim.step()  # staged now: no wait
    assert ckpt._saver.guard.waits == 0  # the timed-out wait is not counted as a wait that ended


def test_restore_waits_for_a_lazy_save_still_staging(root, gate):
    params = Params([torch.zeros(4096)])
    optim = sgd_moving_by(params, 1.0)
    state = {"model": params}
    with tiersave.Checkpointer(root, guard=optim) as ckpt:
        with torch.no_grad():
            params.ps[0].fill_(5)
        ckpt.save(1, state)
        with torch.no_grad():
            params.ps[0].fill_(9)
        handle = ckpt.save_async(2, state, lazy=True)
        restorer, out = run_in_thread(lambda: ckpt.restore(1, into=state))  # writes into the live tensors
        restorer.join(0.3)
        assert restorer.is_alive()
        gate.set()
        restorer.join(30)
        assert "error" not in out
        handle.result(60)
        assert torch.equal(ckpt.restore(2)["model"]["ps.0"], torch.full((4096,), 9.0))
        assert torch.equal(params.ps[0].detach(), torch.full((4096,), 5.0))


def test_a_failed_background_staging_fails_the_save_and_releases_the_hooks(root, monkeypatch):
    real = phased.PhasedStaging.stage
    failing = {0}  # the phases that fail

    def stage(self, phase, after=None):
        if phase in failing:
            raise OSError(f"injected staging failure in phase {phase}")
        return real(self, phase, after)

    monkeypatch.setattr(phased.PhasedStaging, "stage", stage)
    params = Params([torch.zeros(4096)])
    optim = sgd_moving_by(params, 1.0)
    with tiersave.Checkpointer(root, guard=optim) as ckpt:
        with pytest.raises(OSError, match="phase 0"):  # phase 0 runs on the caller's thread
            ckpt.save_async(1, {"model": params}, lazy=True)
        failing.clear()
        failing.add(1)
        handle = ckpt.save_async(2, {"model": params}, lazy=True)
        optim.step()  # the staging failed: nothing to wait for
        with pytest.raises(OSError, match="phase 1"):
            handle.result(60)
        assert ckpt.catalog.steps() == []
        assert [p.name for p in root.iterdir() if p.name.startswith("step-")] == []


def test_bad_lazy_requests_are_refused(root):
    optim = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with tiersave.Checkpointer(root) as ckpt:
        with pytest.raises(ConfigError, match="lazy=True needs a guard"):
            ckpt.save_async(1, {"w": torch.ones(3)}, lazy=True)
        ckpt.guard(optim)
        with pytest.raises(ConfigError, match="lazy=True is for save_async"):
            ckpt.save(1, {"w": torch.ones(3)}, lazy=True)
        with pytest.raises(ConfigError, match="guard\\(\\) takes torch optimizers and modules, got dict"):
            ckpt.guard({"w": torch.ones(3)})
        with pytest.raises(ConfigError, match="timeout_s must be a positive number"):
            ckpt.guard(optim, timeout_s=0)
        assert ckpt.catalog.steps() == []


def test_a_save_larger_than_its_staging_budget_is_staged_before_returning(root):
    params = Params([torch.randn(65536) for _ in range(4)])  # 1 MiB against a 256 KiB budget
    optim = sgd_moving_by(params, 1.0)
    expected = {k: v.clone() for k, v in params.state_dict().items()}
    with tiersave.Checkpointer(root, staging_bytes=256 << 10, guard=optim) as ckpt:
        with pytest.warns(tiersave.TiersaveWarning, match="does not fit its staging memory"):
            handle = ckpt.save_async(1, {"model": params}, lazy=True)
        assert handle.staged() and "lazy" not in handle.stats.extra
        optim.step()
        handle.result(60)
        assert_same(ckpt.restore(1)["model"], expected)


def test_close_removes_the_hooks(root):
    params = Params([torch.zeros(16)])
    optim = sgd_moving_by(params, 1.0)
    ckpt = tiersave.Checkpointer(root, guard=[optim, torch.nn.BatchNorm1d(4)])
    ckpt.save_async(1, {"model": params}, lazy=True).result(60)
    assert optim._optimizer_step_pre_hooks
    ckpt.close()
    assert not optim._optimizer_step_pre_hooks
