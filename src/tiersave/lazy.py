"""The lazy snapshot: ``save_async(..., lazy=True)`` returns before the staging copy ends.

Training may go on while the state is copied, as long as nothing changes a tensor before its bytes are
staged. The :class:`Guard` makes that hold for what it guards: each guarded optimizer's ``step()`` waits
(a step pre-hook) until its parameters and its state are staged, and each guarded module's ``forward()``
waits (a forward pre-hook on every submodule holding buffers) until the module's buffers are staged, as
BatchNorm's running statistics change in forward. Everything else in the state is copied before
``save_async`` returns, as an eager save does: tensors of no guarded object (an RNG state, a parameter that
no guarded optimizer holds, a tensor learning rate, numpy arrays), so no tensor the guard cannot cover is
ever staged late.

Staging order (engine/phased.py): the unguarded tensors on the caller's thread, then on a background thread
the guarded modules' buffers (needed by the next forward), then each guarded optimizer's tensors in the order
they were guarded; each hook waits for its own phase only. Every wait is bounded (``timeout_s``:
``SaveTimeoutError`` naming the step and what waited). On CUDA the copies run on a side stream and a hook
makes the caller's stream wait for its phase's event (written for GPU hosts, not run by the CPU tests).

What the guard cannot see, it cannot cover: an in-place change of a guarded tensor made outside the hooks
(``p.data.mul_()`` between ``save_async`` and the next ``step()``, a buffer changed outside ``forward``)
would reach the checkpoint. docs/guarantees.md says what a lazy save guarantees and what it does not.

Scope: the guard's hooks, which tensor of a save belongs to which phase, starting and awaiting the
background staging of one lazy save.
Anti-scope: copying the bytes (engine/phased.py), writing and committing (saving.py, engine/pipeline.py).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from .engine.phased import PhasedStaging, fits
from .engine.pipeline import StagedWrite
from .engine.pool import DaemonThreadPool
from .errors import ConfigError, SaveTimeoutError, TiersaveWarning
from .state import FlatTensor

log = logging.getLogger(__name__)

_BUFFERS = "buffers"  # the phase of every guarded module's buffers
DEFAULT_TIMEOUT_S = 300.0


class _Pending:
    """One lazy save being staged in the background: a set event per finished phase."""

    def __init__(self, step: int, staging: PhasedStaging, phase_of_owner: dict[Hashable, int], names: list[str]):
        self.step = step
        self.staging = staging
        self.phase_of_owner = phase_of_owner
        self.names = names  # per phase, a few of its tensors' names (for error messages)
        self.events = [threading.Event() for _ in range(staging.phases)]
        self.events[0].set()  # the caller's thread staged phase 0 before save_async returned

    def finished(self) -> bool:
        return self.events[-1].is_set()


class Guard:
    """The optimizers and modules whose hooks let a lazy save stage their tensors after ``save_async`` returns.

    Made by ``Checkpointer.guard(...)`` (or ``Checkpointer(guard=...)``); one per Checkpointer.

    Attributes:
        timeout_s: the longest a hook (or a restore) waits for a lazy save's staging.
        waited_s: the total time hooks waited for staging so far (the stall a lazy save still causes).
        waits: how many hook calls found their tensors not yet staged.
    """

    def __init__(self) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []
        self.modules: list[torch.nn.Module] = []
        self.timeout_s = DEFAULT_TIMEOUT_S
        self.waited_s = 0.0
        self.waits = 0
        self._hooks: dict[int, Any] = {}  # id of a hooked optimizer or (sub)module -> its RemovableHandle
        self._pending: _Pending | None = None
        self._thread: DaemonThreadPool | None = None
        self._warned_fit = False

    def add(self, *owners: Any, timeout_s: float | None = None) -> Guard:
        """Guard optimizers (``torch.optim.Optimizer``) and modules (``torch.nn.Module``); lists of them too.

        Raises:
            ConfigError: an owner that is neither, or a timeout that is not a positive number.
        """
        if timeout_s is not None:
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
                raise ConfigError(f"guard timeout_s must be a positive number of seconds, got {timeout_s!r}")
            self.timeout_s = float(timeout_s)
        for owner in owners:
            if isinstance(owner, (list, tuple)):
                self.add(*owner)
            elif isinstance(owner, torch.optim.Optimizer):
                if id(owner) not in self._hooks:
                    self.optimizers.append(owner)
                    self._hooks[id(owner)] = owner.register_step_pre_hook(self._optimizer_hook)
            elif isinstance(owner, torch.nn.Module):
                if all(m is not owner for m in self.modules):
                    self.modules.append(owner)
                self._hook_modules()
            else:
                raise ConfigError(
                    f"guard() takes torch optimizers and modules, got {type(owner).__name__}: a lazy save can only "
                    "wait for changes it can see (an optimizer's step(), a module's forward())"
                )
        return self

    def close(self) -> None:
        """Remove every hook (after waiting for a lazy save still staging) and stop the staging thread."""
        try:
            self.settle()
        finally:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            if self._thread is not None:
                self._thread.shutdown(wait=True, timeout=self.timeout_s)
                self._thread = None

    def check(self, *, blocking: bool, collective: bool) -> None:
        """Refuse a lazy save that cannot be one (before anything is staged).

        Raises:
            ConfigError: a blocking lazy save, no guard, or a collective Checkpointer.
        """
        if blocking:
            raise ConfigError("lazy=True is for save_async(): a blocking save waits for its copy anyway")
        if not self.optimizers and not self.modules:
            raise ConfigError(
                "lazy=True needs a guard: call ckpt.guard(optimizer, model) (or Checkpointer(guard=...)) so that "
                "optimizer.step() waits until the tensors it changes are staged"
            )
        if collective:
            raise ConfigError("lazy=True is not supported in a collective Checkpointer yet: use save_async() alone")

    # -- a lazy save --------------------------------------------------------------------------------

    def start(self, job: StagedWrite, tensors: Sequence[FlatTensor], step: int, stats: Any) -> Future[None] | None:
        """Stage the unguarded tensors now and the guarded ones on a background thread; the returned future is
        done when every byte is staged (its error is the save's). None: the save does not fit its staging
        arena, so it cannot be lazy; the caller stages it whole (a warning says so, once)."""
        self.settle()
        if not fits(job):
            if not self._warned_fit:
                self._warned_fit = True
                warnings.warn(
                    f"the lazy save of step {step} does not fit its staging memory ({job.ring.capacity} of "
                    f"{job.plan.total_bytes} bytes): it is staged before save_async returns (raise staging_bytes)",
                    TiersaveWarning,
                    stacklevel=4,
                )
            return None
        self._hook_modules()  # submodules that gained buffers since guard() was called
        phase_of, phase_of_owner = self._phases(tensors)
        staging = PhasedStaging(job, phase_of, 1 + len(phase_of_owner))
        names = [", ".join(tensors[i].name for i in members[:3]) for members in staging.members]
        after: Any = None
        if job.pinned:  # device copies must see every kernel queued before this call
            after = torch.cuda.Event()  # type: ignore[no-untyped-call]
            after.record()
        staging.stage(0, after)
        if staging.cuda_events[0] is not None:  # unguarded device tensors: as an eager save does
            torch.cuda.current_stream().wait_event(staging.cuda_events[0])
        later = sum(staging.bytes_in(k) for k in range(1, staging.phases))
        stats.extra["lazy"] = {"eager_bytes": staging.bytes_in(0), "lazy_bytes": later}
        pending = _Pending(step, staging, phase_of_owner, names)
        if staging.phases == 1:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        if self._thread is None:
            self._thread = DaemonThreadPool(1, "tiersave-lazy")
        self._pending = pending
        return self._thread.submit(_run, pending, after)

    def settle(self, timeout: float | None = None) -> None:
        """Wait until the last lazy save is fully staged (a restore into the live state, a close).

        Raises:
            SaveTimeoutError: it was not within ``timeout`` (default :attr:`timeout_s`).
        """
        pending = self._pending
        if pending is None:
            return
        limit = self.timeout_s if timeout is None else timeout
        if not pending.events[-1].wait(limit):
            raise SaveTimeoutError(f"the lazy save of step {pending.step} was not staged within {limit} s")
        self._pending = None

    def _phases(self, tensors: Sequence[FlatTensor]) -> tuple[list[int], dict[Hashable, int]]:
        """Each tensor's phase (0: unguarded, copied now) and each owner's phase: module buffers first (the
        next forward changes them), then each optimizer in the order it was guarded."""
        owner_of: dict[tuple[int, int] | None, Hashable] = {}
        for module in self.modules:
            for buf in module.buffers():
                owner_of.setdefault(_storage_key(buf), _BUFFERS)
        for optim in self.optimizers:
            key = ("optimizer", id(optim))
            for group in optim.param_groups:
                for param in group["params"]:
                    owner_of.setdefault(_storage_key(param), key)
            for per_param in optim.state.values():
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        owner_of.setdefault(_storage_key(value), key)
        order: list[Hashable] = [_BUFFERS, *(("optimizer", id(o)) for o in self.optimizers)]
        owners = [owner_of.get(_source_key(t)) for t in tensors]
        seen = set(owners)
        phase_of_owner = {owner: k + 1 for k, owner in enumerate(o for o in order if o in seen)}
        phase_of = [phase_of_owner.get(owner, 0) for owner in owners]
        return phase_of, phase_of_owner

    # -- the hooks ----------------------------------------------------------------------------------

    def _hook_modules(self) -> None:
        for module in self.modules:
            for sub in module.modules():
                if id(sub) not in self._hooks and next(sub.buffers(recurse=False), None) is not None:
                    self._hooks[id(sub)] = sub.register_forward_pre_hook(self._module_hook)

    def _optimizer_hook(self, optim: Any, args: Any, kwargs: Any) -> None:
        self._wait(("optimizer", id(optim)), f"{type(optim).__name__}.step()")

    def _module_hook(self, module: Any, args: Any) -> None:
        self._wait(_BUFFERS, f"{type(module).__name__}.forward()")

    def _wait(self, owner: Hashable, who: str) -> None:
        """Block until ``owner``'s phase of the pending lazy save is staged (and, on CUDA, make the caller's
        stream wait for its copies). A failed staging wakes it too: the save's error is on its handle."""
        pending = self._pending
        if pending is None:
            return
        phase = pending.phase_of_owner.get(owner)
        if phase is None:
            return
        event = pending.events[phase]
        if not event.is_set():
            start = time.perf_counter()
            if not event.wait(self.timeout_s):
                raise SaveTimeoutError(
                    f"{who} waited {self.timeout_s} s for the lazy save of step {pending.step} to stage the tensors "
                    f"it changes ({pending.names[phase]}, ...); it did not, so they were left unchanged"
                )
            self.waited_s += time.perf_counter() - start
            self.waits += 1
        device_copies = pending.staging.cuda_events[phase]
        if device_copies is not None:
            torch.cuda.current_stream().wait_event(device_copies)


def _run(pending: _Pending, after: Any) -> None:
    """The background thread: stage each later phase, announcing each; on failure wake every waiter."""
    try:
        for phase in range(1, pending.staging.phases):
            pending.staging.stage(phase, after)
            pending.events[phase].set()
    finally:
        for event in pending.events:
            event.set()


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """Tensors sharing memory share this key (a module's ``state_dict()`` hands out detached views): the
    device index (-1: host) and the address where the tensor's storage starts, read without making a
    storage object (a few microseconds each, per tensor and per save)."""
    return t.get_device(), t.data_ptr() - int(t.storage_offset()) * t.element_size()


def _source_key(t: FlatTensor) -> tuple[int, int] | None:
    """The storage key of a saved tensor; None (never guarded: copied at once) for arrays and empty tensors."""
    source = t.source
    if not isinstance(source, torch.Tensor) or not t.nbytes:
        return None
    try:
        return _storage_key(source)
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage: copy it at once
        return None
