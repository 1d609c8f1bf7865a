"""Follow a checkpoint root: yield each newly committed checkpoint, for a process that loads them as training
goes on (an inference service taking intermediate checkpoints, an evaluator, continuous learning).

Scope: noticing commits by polling the root's catalog (committed means the manifest is there: a checkpoint
being written is invisible, so a watcher never sees a partial one), in step order, with a bounded wait.
Anti-scope: loading (``Checkpointer.restore``, which also lists again when the writer's retention deletes a
checkpoint while it is read), notifications from the writer (none are needed: the commit is the signal).

Torch-free: ``tiersave watch`` and a watcher that only reacts to steps need no torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

from .catalog import Catalog, CheckpointInfo
from .errors import CheckpointNotFoundError, ConfigError, FormatError
from .storage import open_storage
from .storage.base import Storage

__all__ = ["watch"]


def watch(
    root: str | os.PathLike[str] | Storage,
    *,
    after: int | None = None,
    include_existing: bool = False,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[CheckpointInfo]:
    """Yield each checkpoint committed under ``root``, oldest first, as it appears.

    Example (an inference process following training)::

        ckpt = tiersave.Checkpointer("/ckpt/run1")
        for info in tiersave.watch("/ckpt/run1", timeout_s=3600):
            ckpt.restore(info.step, into={"model": model})   # a verified, fully committed checkpoint

    Args:
        root: the checkpoint root (a path, URI or ``Storage``), read only.
        after: yield only steps greater than this. Default: the newest step when the call starts (only new
            checkpoints), or nothing with ``include_existing``.
        include_existing: also yield the checkpoints already committed (when ``after`` is None).
        poll_s: seconds between looks at the root.
        timeout_s: stop (the iterator ends) when no new checkpoint appeared for this long; None: never.
        sleep: the wait between polls (tests pass their own).

    A checkpoint deleted by the writer's retention before it was seen is skipped: a watcher that falls behind
    gets the newest ones, never an error. Steps that are not newer than the last one yielded are not yielded
    again (a writer that restarts from an older step continues past the newest seen).

    Raises:
        ConfigError: ``poll_s`` or ``timeout_s`` is not positive.
        StorageError: the root cannot be read.
    """
    if not poll_s > 0:
        raise ConfigError(f"poll_s must be a positive number of seconds, got {poll_s!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    storage: Storage = open_storage(root, create=False) if isinstance(root, (str, os.PathLike)) else root
    catalog = Catalog(storage)
    last = after
    if last is None and not include_existing:
        steps = catalog.steps()
        last = steps[-1] if steps else None
    waited_since = time.monotonic()
    while True:
        fresh = [s for s in catalog.steps() if last is None or s > last]
        for step in fresh:
            try:
                info = catalog.info(step)
            except (CheckpointNotFoundError, FormatError):  # deleted by retention, or unreadable: not ours
                continue
            last = step
            waited_since = time.monotonic()
            yield info
        if timeout_s is not None and time.monotonic() - waited_since >= timeout_s:
            return
        sleep(poll_s)
