"""Waiting on groups of futures (no tiersave imports: usable from every layer)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

_GLANCE_S = 0.05  # an idle thread runs a no-op well within this
T = TypeVar("T")


def running_future() -> Future[T]:
    """A future already marked running, for a result a background task sets later and a caller may wait on:
    the caller's ``cancel()`` then returns False instead of making the task's ``set_result`` raise."""
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()
    return future


def wait_all(futures: Iterable[Future[Any]]) -> None:
    """Wait for ``futures``; on the first failure cancel those not started, wait for the running ones (so
    nothing still touches shared buffers or files), then re-raise that failure."""
    done, pending = wait(list(futures), return_when=FIRST_EXCEPTION)
    for fut in pending:
        fut.cancel()
    wait(pending)
    for fut in done:
        fut.result()


def unfinished_queues(executors: Sequence[Executor], timeout: float | None) -> list[int]:
    """Wait until every task queued so far on each single-threaded executor has run: a no-op queued now runs
    after them. The executors are waited for in order, because a task on one may queue work on a later one.
    Returns the indexes of those whose queue had not run out when ``timeout`` seconds passed (empty: all
    did). Once it has passed, the executors not yet looked at get one brief look together (``_GLANCE_S``,
    their no-ops queued at once and waited for side by side), so the whole wait ends at most that long after
    ``timeout`` and an idle queue is never reported unfinished for a busy one's sake. A shut-down executor
    has nothing pending."""
    deadline = None if timeout is None else time.monotonic() + timeout
    unfinished: list[int] = []
    for index, executor in enumerate(executors):
        if deadline is not None and time.monotonic() >= deadline:
            return unfinished + _glance(executors, index)
        remaining = None if deadline is None else deadline - time.monotonic()
        try:
            executor.submit(lambda: None).result(remaining)
        except FutureTimeout:
            unfinished.append(index)
        except RuntimeError:  # shut down: nothing can be pending
            pass
    return unfinished


def _glance(executors: Sequence[Executor], first: int) -> list[int]:
    """The indexes from ``first`` on whose no-op has not run within one shared ``_GLANCE_S``: every no-op is
    queued before any is waited for, so an idle executor runs its own while a busy one's wait uses the look."""
    probes: dict[int, Future[Any]] = {}
    for index in range(first, len(executors)):
        try:
            probes[index] = executors[index].submit(lambda: None)
        except RuntimeError:  # shut down: nothing can be pending
            pass
    end = time.monotonic() + _GLANCE_S
    late = []
    for index, probe in probes.items():
        try:
            probe.result(max(0.0, end - time.monotonic()))
        except FutureTimeout:
            late.append(index)
    return late
