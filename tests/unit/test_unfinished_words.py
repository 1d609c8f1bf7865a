"""What ``close()``, ``wait()`` and the exit hook say when their bounded wait times out: a save that did not
commit is "not visible"; a committed save whose follow-up (a drain to a later tier, the removal of deleted
checkpoints' files) did not finish is named committed, with the follow-up that did not finish."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
import threading
import warnings
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import pytest
import torch
from test_reclaim import GatedRemovals

import tiersave
from tiersave import _futures, _lifecycle
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import Fault, FaultyStorage


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4096, dtype=torch.float32)}


def _close_warning(ckpt: tiersave.Checkpointer, timeout: float) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ckpt.close(timeout=timeout) is False
    (warning,) = [w for w in caught if issubclass(w.category, tiersave.TiersaveWarning)]
    return str(warning.message)


def test_a_committed_save_whose_drain_is_stuck_is_named_committed(tmp_path: Path) -> None:
    gate = threading.Event()
    slow = FaultyStorage(LocalStorage(tmp_path / "slow"), gates={"finish": gate})
    tiers = [tiersave.Tier(tmp_path / "fast", name="fast"), tiersave.Tier(slow, name="slow")]
    ckpt = tiersave.Checkpointer(tiers=tiers, event_log=False, handle_sigterm=False)
    try:
        handle = ckpt.save(1, _state())  # committed on the first tier; its drain to "slow" waits at the gate
        assert handle.done() and not handle.failed()
        assert ckpt.wait(timeout=0.2) is False
        message = _close_warning(ckpt, 0.2)
    finally:
        gate.set()
    assert "the save of step 1 is committed in" in message, message
    # the drain is named among what did not finish (an idle retention thread slow to answer may come first)
    assert "its follow-up did not finish before close: " in message and "the drain to tier slow" in message, message
    assert "not visible" not in message and "previous one" not in message, message
    with tiersave.Checkpointer(tmp_path / "fast", handle_sigterm=False) as again:
        assert again.catalog.steps() == [1]  # what the message says: step 1 is there
        assert torch.equal(again.restore(1)["w"], _state()["w"])


def test_a_committed_save_whose_removals_are_stuck_is_named_committed(tmp_path: Path) -> None:
    storage = GatedRemovals(tmp_path)
    ckpt = tiersave.Checkpointer(storage, keep_last=1, event_log=False, handle_sigterm=False)
    try:
        ckpt.save(1, _state())
        ckpt.save(2, _state())  # retention renames step 1 away; the removal of its files waits at the gate
        message = _close_warning(ckpt, 0.2)
    finally:
        storage.gate.set()
    assert "the save of step 2 is committed in" in message, message
    assert "the removal of deleted checkpoints' files" in message, message
    assert "drain" not in message and "not visible" not in message, message


def test_close_says_an_uncommitted_save_goes_on_and_the_words_stay_true_once_it_commits(tmp_path: Path) -> None:
    """close() does not stop a commit already running: its words must not call the save lost, since it
    becomes visible when it commits (the old words said "it is not visible")."""
    gate = threading.Event()
    ckpt = tiersave.Checkpointer(
        FaultyStorage(LocalStorage(tmp_path), gates={"finish": gate}), event_log=False, handle_sigterm=False
    )
    try:
        handle = ckpt.save_async(3, _state())
        message = _close_warning(ckpt, 0.2)
        assert not handle.done()
    finally:
        gate.set()
    assert "the save of step 3 had not committed before close; it goes on in the background and becomes " in message
    assert "visible only if it commits (until then the newest checkpoint in" in message, message
    assert "is committed" not in message and "is not visible" not in message, message
    assert handle.wait(60) and not handle.failed()  # what the words allowed: it committed after all
    with tiersave.Checkpointer(tmp_path, handle_sigterm=False) as again:
        assert again.catalog.steps() == [3]


class _FakeSave:
    """The part of a save handle the waits read, for a save that does not fail."""

    step = 5

    def exception(self) -> BaseException | None:
        return None

    def _unobserved_error(self) -> BaseException | None:
        return None

    def _peek_error(self) -> BaseException | None:
        return None


class _SaveCommittingJustAfterTheDeadline(_FakeSave):
    """A save whose commit lands right after its wait timed out, before the words about that wait are built."""

    def __init__(self) -> None:
        self.waited = False

    def wait(self, timeout: float | None = None) -> bool:
        self.waited = True
        return False

    def done(self) -> bool:
        return self.waited  # committed as soon as the wait has given up


def test_the_words_come_from_one_snapshot_taken_when_the_wait_ended() -> None:
    """A commit landing between the timeout and the message used to give "the save of step 5 is committed ...;
    its follow-up did not finish ...: the save of step 5"."""
    outcome = _lifecycle.wait_for(_SaveCommittingJustAfterTheDeadline(), [], 0.1)
    assert not outcome.done and not outcome.committed
    message = _lifecycle.unfinished_message(outcome, "/root", "within 0 s")
    assert message.startswith("the save of step 5 had not committed within 0 s; it goes on in the background")
    assert "is committed" not in message, message
    at_exit = _lifecycle.unfinished_message(outcome, "/root", "within 0 s", at_exit=True)
    assert at_exit == (
        "the save of step 5 did not finish within 0 s; it is not visible (the newest checkpoint in /root is the "
        "previous one)"
    )


class _Clock:
    """A fake ``time.monotonic`` that moves only when a fake wait below spends time: no wall time is involved."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _SaveCommittingAfter(_FakeSave):
    """A save handle whose commit takes ``took`` seconds of the fake clock."""

    def __init__(self, clock: _Clock, took: float) -> None:
        self.clock, self.took, self.step = clock, took, 1

    def wait(self, timeout: float | None = None) -> bool:
        self.clock.now += self.took
        return True

    def done(self) -> bool:
        return True


class _StuckQueue(Executor):
    """A follow-up queue whose work never runs out: every look at it spends all the time it is given."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.looks: list[float | None] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        queue = self

        class Never(Future[Any]):
            def result(self, timeout: float | None = None) -> Any:
                queue.looks.append(timeout)
                queue.clock.now += timeout or 0.0
                raise FutureTimeout

        return Never()


def test_wait_spends_its_timeout_once_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """The save's wait and its follow-up's wait share one deadline (they used to get the whole timeout each).
    Checked on a fake clock, so a loaded machine cannot change the outcome."""
    clock = _Clock()
    monkeypatch.setattr(_lifecycle, "time", clock)
    monkeypatch.setattr(_futures, "time", clock)
    queues = [_StuckQueue(clock) for _ in range(4)]
    named = [(str(i), queue) for i, queue in enumerate(queues)]
    outcome = _lifecycle.wait_for(_SaveCommittingAfter(clock, 0.4), named, 1.0)
    assert outcome.unfinished == ("0", "1", "2", "3")
    assert queues[0].looks == [pytest.approx(0.6)]  # what the commit left of the 1 s, not another whole second
    assert queues[1].looks == [pytest.approx(_futures._GLANCE_S)]  # the deadline has passed: a glance
    assert queues[2].looks == queues[3].looks == [0.0]  # shared by the rest (each had its own: 1.15 s in all)
    assert clock.now - 1000.0 == pytest.approx(1.0 + _futures._GLANCE_S)


EXIT_WITH_A_SLOW_DRAIN = textwrap.dedent("""
    import torch, tiersave
    from tiersave.storage.posix import LocalStorage
    from tiersave.testing.faults import FaultyStorage
    slow = FaultyStorage(LocalStorage({slow!r}), delays={{"finish": 30.0}})
    ckpt = tiersave.Checkpointer(
        tiers=[tiersave.Tier({fast!r}, name="fast"), tiersave.Tier(slow, name="slow")], exit_timeout_s=1
    )
    ckpt.save(7, {{"w": torch.ones(1000)}})
""")


def test_the_exit_hook_names_a_committed_save_committed(tmp_path: Path) -> None:
    body = EXIT_WITH_A_SLOW_DRAIN.format(fast=str(tmp_path / "fast"), slow=str(tmp_path / "slow"))
    script = tmp_path / "script.py"
    script.write_text(body)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "tiersave: the save of step 7 is committed in" in out.stderr, out.stderr
    assert "its follow-up did not finish within 1 s: the drain to tier slow" in out.stderr, out.stderr
    assert "not visible" not in out.stderr, out.stderr
    with tiersave.Checkpointer(tmp_path / "fast", handle_sigterm=False) as ckpt:
        assert ckpt.catalog.steps() == [7]


@pytest.mark.parametrize("timeout", [0.0, 0.1])
def test_wait_names_nothing_once_everything_finished(
    tmp_path: Path, timeout: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle follow-up is not reported unfinished, even by a wait with no time left (it gets a glance). The
    glance is made long here: on a loaded machine an idle thread may take longer than 50 ms to run a no-op,
    and what is tested is that an idle queue is looked at, not how fast the machine schedules it."""
    monkeypatch.setattr(_futures, "_GLANCE_S", 60.0)
    with tiersave.Checkpointer(tmp_path, keep_last=1, event_log=False, handle_sigterm=False) as ckpt:
        ckpt.save(1, _state())
        ckpt.save(2, _state())
        assert ckpt.wait(timeout=60)
        assert ckpt.wait(timeout=timeout) and ckpt._last_wait is not None and ckpt._last_wait.unfinished == ()


def _a_failed_save_behind_a_held_drain(tmp_path: Path) -> tuple[tiersave.Checkpointer, threading.Event, Any]:
    """Step 1 committed with its drain to a second tier held at a gate; step 2 failed (no space) meanwhile."""
    gate = threading.Event()
    no_space = Fault("finish", nth=2, error=lambda: OSError(errno.ENOSPC, "No space left on device"))
    fast = FaultyStorage(LocalStorage(tmp_path / "fast"), [no_space])
    slow = FaultyStorage(LocalStorage(tmp_path / "slow"), gates={"finish": gate})
    tiers = [tiersave.Tier(fast, name="fast"), tiersave.Tier(slow, name="slow")]
    ckpt = tiersave.Checkpointer(tiers=tiers, event_log=False, handle_sigterm=False)
    ckpt.save(1, _state())  # committed; its drain to "slow" waits at the gate
    handle = ckpt.save_async(2, _state())
    assert handle.wait(60) and handle.failed()
    return ckpt, gate, handle


def test_a_failed_save_is_raised_as_itself_while_an_earlier_drain_is_still_running(tmp_path: Path) -> None:
    """The last save fails (no space) while the drain of an earlier one is held: wait() used to return False
    before looking at the error, and the integrations then raised SaveTimeoutError("... FAILED ...") instead,
    losing the error's type and cause."""
    ckpt, gate, handle = _a_failed_save_behind_a_held_drain(tmp_path)
    try:
        with pytest.raises(tiersave.NoSpaceError, match="No space left") as raised:
            ckpt.wait(timeout=0.2)
        assert raised.value is handle._peek_error()  # the save's own error object, its cause kept
        assert ckpt._last_wait is not None and ckpt._last_wait.unfinished  # the drain is indeed still held
        assert handle._unobserved_error() is None  # raised once: close() does not raise it again
    finally:
        gate.set()
        ckpt.close()


def test_close_raises_a_failed_save_while_an_earlier_drain_is_still_running(tmp_path: Path) -> None:
    """close() used to only warn (a filterable warning) when the wait also timed out on a held drain."""
    ckpt, gate, _ = _a_failed_save_behind_a_held_drain(tmp_path)
    try:
        with pytest.warns(tiersave.TiersaveWarning), pytest.raises(tiersave.SaveError, match="step 2"):
            ckpt.close(timeout=0.2)
    finally:
        gate.set()


def test_an_idle_queue_is_not_named_for_busy_ones_sake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the deadline has passed, the queues not yet looked at share one look; the idle ones among them used
    to be looked at with nothing left of it (result(0.0) on a no-op queued that instant) and were named
    unfinished. The look is long here so that only the sharing, not the machine's load, decides."""
    from concurrent.futures import ThreadPoolExecutor

    class SlowToSchedule(Executor):  # idle, but its thread gets the CPU 0.3 s later, as on a loaded machine
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
            fut: Future[Any] = Future()
            threading.Timer(0.3, fut.set_result, (None,)).start()
            return fut

    monkeypatch.setattr(_futures, "_GLANCE_S", 2.0)
    gate = threading.Event()
    busy = [ThreadPoolExecutor(1) for _ in range(2)]
    try:
        for pool in busy:
            pool.submit(gate.wait, 60)  # busy until the gate opens
        assert _futures.unfinished_queues([*busy, SlowToSchedule()], 0.0) == [0, 1]  # the idle third: not named
    finally:
        gate.set()
        for pool in busy:
            pool.shutdown(wait=True)
