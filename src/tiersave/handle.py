"""``SaveHandle``: what ``save()`` returns, and how a save's outcome (or failure) reaches the caller.

A handle has two moments: *staged* (the state has been captured; the training loop may change its
tensors) and *durable* (the checkpoint is committed; ``result()`` returns its info). A synchronous save
returns a handle that is already both. A failure is stored on the handle and re-raised by ``result()``;
the Checkpointer also re-raises an unobserved failure at the next ``save()``, so a lost save is never
silent.

Thread safety: every method may be called from any thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from .catalog import CheckpointInfo
from .errors import SaveTimeoutError


@dataclass
class SaveStats:
    """Timings and sizes of one save, in seconds and bytes."""

    step: int
    blocked_s: float = 0.0
    flatten_s: float = 0.0
    stage_s: float = 0.0
    stage_wait_s: float = 0.0
    write_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0
    tensor_bytes: int = 0
    stored_bytes: int = 0
    num_tensors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def write_gbps(self) -> float:
        return self.stored_bytes / self.write_s / 1e9 if self.write_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "blocked_s": round(self.blocked_s, 6),
            "flatten_s": round(self.flatten_s, 6),
            "stage_s": round(self.stage_s, 6),
            "stage_wait_s": round(self.stage_wait_s, 6),
            "write_s": round(self.write_s, 6),
            "commit_s": round(self.commit_s, 6),
            "total_s": round(self.total_s, 6),
            "tensor_bytes": self.tensor_bytes,
            "stored_bytes": self.stored_bytes,
            "num_tensors": self.num_tensors,
            "write_gbps": round(self.write_gbps, 4),
            **self.extra,
        }


class SaveHandle:
    """The outcome of one ``save()``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.stats = SaveStats(step)
        self.skipped = False
        self._staged = threading.Event()
        self._future: Future[CheckpointInfo | None] = Future()
        self._observed = False
        self.tiers: dict[str, Future[CheckpointInfo | None]] = {}
        """Per later tier that this save is sent to: its future, done when durable there."""

    @classmethod
    def skipped_save(cls, step: int) -> SaveHandle:
        """A handle for a save that back-pressure skipped: done, not failed, ``result()`` is None."""
        handle = cls(step)
        handle.skipped = True
        handle._observed = True
        handle._staged.set()
        handle._future.set_result(None)
        return handle

    # -- producer side (the Checkpointer) ---------------------------------------------------------

    def _set_staged(self) -> None:
        self._staged.set()

    def _set_result(self, info: CheckpointInfo) -> None:
        self._staged.set()
        self._future.set_result(info)

    def _set_error(self, exc: BaseException) -> None:
        self._staged.set()
        self._future.set_exception(exc)

    # -- consumer side ----------------------------------------------------------------------------

    def staged(self) -> bool:
        """True once the state is captured and the caller may modify its tensors."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        return self._staged.wait(timeout)

    def done(self) -> bool:
        """True once the save is committed or has failed."""
        return self._future.done()

    def failed(self) -> bool:
        return self._future.done() and self._future.exception() is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the save is committed or failed, without raising; True if it is done."""
        try:
            self._future.exception(timeout)
        except FutureTimeout:
            return False
        return True

    def result(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait until the checkpoint is durable and return its info (None for a skipped save);
        re-raise the save's error.

        Raises:
            SaveTimeoutError: ``timeout`` seconds passed first (the save goes on).
            TiersaveError: the save failed; nothing of it became visible.
        """
        try:
            info = self._future.result(timeout)
        except FutureTimeout:
            raise SaveTimeoutError(f"save of step {self.step} not finished after {timeout} s") from None
        except BaseException:
            self._observed = True
            raise
        self._observed = True
        return info

    def tier_result(self, tier: str, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait until the checkpoint is durable on ``tier`` (a later tier of the chain) and return its info
        there; re-raise the drain's error. The first tier is ``result()``. A save that found the tier busy waits
        to be copied once it is idle: its result comes with that catch-up.

        Raises:
            ConfigError: this save is not sent to ``tier``: its cadence skipped it (or, on many nodes, the tier
                was busy: a part drain does not catch up).
            DrainSupersededError: it waited for the busy tier and a newer save took its place.
        """
        from .errors import ConfigError

        future = self.tiers.get(tier)
        if future is None:
            raise ConfigError(
                f"the save of step {self.step} is not sent to tier {tier!r} (sent to: "
                f"{', '.join(self.tiers) or 'no later tier'}): its cadence skipped it (or, on many nodes, the tier "
                "was still copying an earlier checkpoint)"
            )
        try:
            return future.result(timeout)
        except FutureTimeout:
            raise SaveTimeoutError(f"step {self.step} not durable on {tier} after {timeout} s") from None

    def exception(self) -> BaseException | None:
        """The save's error once done (marks it observed), else None."""
        if not self._future.done():
            return None
        self._observed = True
        return self._future.exception()

    def _peek_error(self) -> BaseException | None:
        """The save's error once done, without marking it observed (for words about a wait that ended)."""
        return self._future.exception() if self._future.done() else None

    def _unobserved_error(self) -> BaseException | None:
        if self._future.done() and not self._observed:
            return self._future.exception()
        return None

    def __repr__(self) -> str:
        if self.skipped:
            state = "skipped"
        else:
            state = "failed" if self.failed() else ("durable" if self.done() else "in progress")
        return f"<SaveHandle step={self.step} {state}>"
