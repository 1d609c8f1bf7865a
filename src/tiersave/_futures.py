"""Waiting on groups of futures (no tiersave imports: usable from every layer)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


def wait_all(futures: Iterable[Future[Any]]) -> None:
    """Wait for ``futures``; on the first failure cancel those not started, wait for the running ones (so
    nothing still touches shared buffers or files), then re-raise that failure."""
    done, pending = wait(list(futures), return_when=FIRST_EXCEPTION)
    for fut in pending:
        fut.cancel()
    wait(pending)
    for fut in done:
        fut.result()


def wait_queues(executors: Iterable[Executor], timeout: float | None) -> bool:
    """Wait until every task queued so far on each single-threaded ``executor`` has run: a no-op queued
    now runs after them. Returns False if ``timeout`` seconds passed first; a shut-down executor has
    nothing pending."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for executor in executors:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            executor.submit(lambda: None).result(remaining)
        except FutureTimeout:
            return False
        except RuntimeError:  # shut down: nothing can be pending
            pass
    return True
