"""Waiting on groups of futures (no tiersave imports: usable from every layer)."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, wait
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
