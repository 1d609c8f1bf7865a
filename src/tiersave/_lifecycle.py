"""Process exit and SIGTERM: finish the in-flight save, or say clearly that it did not finish.

Every open Checkpointer is registered (weakly). At interpreter exit, and on SIGTERM when enabled, the hook
of each one (:func:`finish_or_report`) waits (bounded by its ``exit_timeout_s``) for its in-flight save and
the save's follow-up (retention, drains to later tiers, the removal of deleted checkpoints' files), and writes
one line to stderr if any of it could not finish or the save failed. The line says which (:func:`unfinished_message`),
built from one snapshot of the save's state at the deadline (:class:`WaitOutcome`): a save that did not commit is
never half-visible, it is simply not committed; a committed save whose follow-up did not finish is named
committed, with what did not finish. Background threads are daemons, so a stuck write cannot hang the exit itself.
Callers that go on living (``close()``, the trainer integrations) say that an uncommitted save goes on in the
background and becomes visible only if it commits: closing does not stop a commit already running.

The SIGTERM handler is installed once, only from the main thread. It chains to a handler that was
installed before it; when there was none (the default action), it re-delivers SIGTERM with the default
action after the wait, so the process still ends with the usual status.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

from ._futures import unfinished_queues


class _Save(Protocol):
    """What the hook reads of a save handle."""

    @property
    def step(self) -> int: ...
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def exception(self) -> BaseException | None: ...
    def _unobserved_error(self) -> BaseException | None: ...
    def _peek_error(self) -> BaseException | None: ...


@dataclass(frozen=True)
class ExitState:
    """A registered object's state at exit: where it saves, the step being staged (if the caller's thread is
    inside ``save``), the in-flight save, and how long to wait for it."""

    uri: str
    staging_step: int | None
    inflight: _Save | None
    timeout_s: float


@dataclass(frozen=True)
class WaitOutcome:
    """One snapshot, taken when a bounded wait ended, of the save it waited for and of its follow-up; the words
    about that wait are built from it alone, so a commit landing a moment later cannot make them contradict."""

    step: int
    done: bool  # committed or failed when the wait ended
    error: BaseException | None  # the save's error (done and failed)
    unfinished: tuple[str, ...]  # what did not finish, named (empty: everything did)

    @property
    def committed(self) -> bool:
        return self.done and self.error is None


class _Hooked(Protocol):
    _last_wait: WaitOutcome | None  # what the last wait() found when it ended

    def _exit_state(self) -> ExitState | None: ...
    def wait(self, timeout: float | None = None, *, raise_errors: bool = True) -> bool: ...


_live: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.RLock()  # re-entrant: a SIGTERM handler may run while this thread holds it
_atexit_installed = False
_sigterm_installed = False
_previous_handler: Any = None


def register(obj: _Hooked, *, handle_sigterm: bool) -> None:
    global _atexit_installed
    with _lock:
        _live.add(obj)
        if not _atexit_installed:
            atexit.register(_run_hooks, "the interpreter is exiting")
            _atexit_installed = True
    if handle_sigterm:
        _install_sigterm()


def unregister(obj: _Hooked) -> None:
    with _lock:
        _live.discard(obj)


def _run_hooks(reason: str) -> None:
    with _lock:
        live = list(_live)
    for obj in live:
        try:
            finish_or_report(obj, reason)
        except Exception as exc:  # never let one checkpointer's problem stop the others' hooks
            os.write(2, f"tiersave: exit hook failed: {exc}\n".encode())


def finish_or_report(obj: _Hooked, reason: str) -> None:
    """Finish ``obj``'s in-flight save (bounded wait), or say on stderr that it did not finish or failed."""
    state = obj._exit_state()
    if state is None:
        return
    pending = state.inflight
    if state.staging_step is not None:
        sys.stderr.write(
            f"tiersave: {reason} while staging step {state.staging_step}; that save is abandoned and not "
            f"visible (the newest checkpoint in {state.uri} is unchanged)\n"
        )
        return
    if pending is not None and not pending.done():
        sys.stderr.write(
            f"tiersave: {reason}: finishing the save of step {pending.step} (up to {state.timeout_s:.0f} s)\n"
        )
    if not obj.wait(state.timeout_s, raise_errors=False):
        within = f"within {state.timeout_s:.0f} s"
        sys.stderr.write(f"tiersave: {unfinished_message(obj._last_wait, state.uri, within, at_exit=True)}\n")
        return
    if pending is not None and pending._unobserved_error() is not None:
        sys.stderr.write(f"tiersave: the save of step {pending.step} FAILED: {pending.exception()}\n")


def wait_for(pending: _Save, follow_ups: Sequence[tuple[str, Executor]], timeout: float | None) -> WaitOutcome:
    """Wait, ``timeout`` seconds in all, for ``pending`` to commit or fail, then for its follow-up: the tasks
    queued so far on ``follow_ups``' single-threaded executors, each named by what it does, in the order they
    hand work on. Returns what was found: the save's state is read once, when its own wait ends."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if not pending.wait(timeout):
        return WaitOutcome(pending.step, False, None, (f"the save of step {pending.step}",))
    error = pending._peek_error()
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    unfinished = tuple(follow_ups[i][0] for i in unfinished_queues([queue for _, queue in follow_ups], left))
    return WaitOutcome(pending.step, True, error, unfinished)


def after_timeout(obj: _Hooked, within: str) -> tuple[bool, str]:
    """After ``obj.wait()`` timed out: whether its last save was committed when the wait ended (then only its
    follow-up did not finish), and :func:`unfinished_message`'s words for what did not, for the adapters that
    report it."""
    state = obj._exit_state()
    outcome = obj._last_wait
    committed = outcome is not None and outcome.committed
    return committed, unfinished_message(outcome, state.uri if state else "?", within)


def unfinished_message(outcome: WaitOutcome | None, uri: str, within: str, *, at_exit: bool = False) -> str:
    """What a wait that timed out (``within``: "within 30 s", "before close") left, in words that stay true: a
    save that had not committed is not visible yet (``at_exit``: never, the process ends); one that committed
    is, and only its follow-up (as :func:`wait_for` named it) did not finish."""
    if outcome is None or not outcome.done:
        step = outcome.step if outcome is not None else "?"
        if at_exit:
            return (
                f"the save of step {step} did not finish {within}; it is not visible "
                f"(the newest checkpoint in {uri} is the previous one)"
            )
        return (
            f"the save of step {step} had not committed {within}; it goes on in the background and becomes "
            f"visible only if it commits (until then the newest checkpoint in {uri} is the previous one)"
        )
    rest = "; ".join(outcome.unfinished)
    if outcome.error is not None:
        return (
            f"the save of step {outcome.step} FAILED and is not visible: {outcome.error}; the follow-up of earlier "
            f"saves did not finish {within}: {rest}"
        )
    return f"the save of step {outcome.step} is committed in {uri}; its follow-up did not finish {within}: {rest}"


def _install_sigterm() -> None:
    global _sigterm_installed, _previous_handler
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter, or signals unavailable
        return
    _previous_handler = previous
    _sigterm_installed = True


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _run_hooks("SIGTERM received")
    previous = _previous_handler
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
