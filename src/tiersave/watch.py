"""Follow a checkpoint root: yield each newly committed checkpoint, for a process that loads them as training
goes on (an inference service taking intermediate checkpoints, an evaluator, continuous learning).

Scope: noticing commits by looking at the root's catalog (woken by inotify on local roots and ``mem://``, polling
elsewhere) (committed means the manifest is there: a checkpoint
being written is invisible, so a watcher never sees a partial one), in step order, with a bounded wait; or,
with ``tag=``, each move of a movable tag (tags.py: one atomic object, so never a half-moved tag).
Anti-scope: loading (``Checkpointer.restore``, which also lists again when the writer's retention deletes a
checkpoint while it is read), notifications from the writer (none are needed: the commit is the signal).

Torch-free: ``tiersave watch`` and a watcher that only reacts to steps need no torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .catalog import Catalog, CheckpointInfo
from .errors import CheckpointNotFoundError, ConfigError, FormatError
from .leases import ReadLease
from .storage import open_storage
from .storage.base import Storage
from .storage.posix import LocalStorage
from .storage.posix.notify import DirNotifier, dir_notifier
from .tags import check_name

__all__ = ["watch"]


def watch(
    root: str | os.PathLike[str] | Storage,
    *,
    after: int | None = None,
    include_existing: bool = False,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    tag: str | None = None,
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
        poll_s: seconds between looks at the root. On a local root or ``mem://`` (Linux) inotify wakes the
            watcher as soon as a checkpoint is committed or a tag moves, and ``poll_s`` only bounds the wait.
        timeout_s: stop (the iterator ends) when no new checkpoint appeared for this long; None: never.
        sleep: the wait between polls (tests pass their own; then no inotify is used).
        tag: follow this movable tag (``ckpt.tag(step, name)``, ``tiersave tag``) instead of every commit: yield
            the checkpoint it points to each time it moves (to a newer step or back to an older one), and its
            current one first with ``include_existing``. ``after`` does not apply.

    A checkpoint deleted by the writer's retention before it was seen is skipped: a watcher that falls behind
    gets the newest ones, never an error. Each checkpoint yielded is held by a read lease until the loop asks
    for the next one (or closes the feed): the writer's retention, in any process, keeps it while the loop's
    body reads it (docs/guarantees.md, "Read leases"). Steps that are not newer than the last one yielded are
    not yielded again (a writer that restarts from an older step continues past the newest seen).

    Raises:
        ConfigError: ``poll_s`` or ``timeout_s`` is not positive, a bad ``tag`` name, or ``tag`` with ``after``.
        FormatError: the followed tag's file is not a tag record.
        StorageError: the root cannot be read.
    """
    if not poll_s > 0:
        raise ConfigError(f"poll_s must be a positive number of seconds, got {poll_s!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")
    storage: Storage = open_storage(root, create=False) if isinstance(root, (str, os.PathLike)) else root
    catalog = Catalog(storage)
    # Where the feed starts is read now, not at the first next(): a commit between the call and the first
    # next() is yielded, as the docstring promises.
    if tag is not None:
        if after is not None:
            raise ConfigError("watch(tag=...) follows the tag wherever it moves; it takes no after=")
        check_name(tag)
        current = None if include_existing else catalog.tags.get(tag)
        seen = (current.step, current.manifest_sha256) if current is not None else None
        wait = _Waiter(storage, sleep, tags=True)
        return _closing(_tag_moves(catalog, tag, seen, poll_s, timeout_s, wait), wait)
    if after is None and not include_existing:
        steps = catalog.steps()
        after = steps[-1] if steps else None
    wait = _Waiter(storage, sleep, tags=False)
    return _closing(_commits(catalog, after, poll_s, timeout_s, wait), wait)


class _Waiter:
    """The wait between two looks: until something changes in the root (inotify, local roots) or ``poll_s``."""

    def __init__(self, storage: Storage, sleep: Callable[[float], None], *, tags: bool) -> None:
        self._sleep = sleep
        self._notifier: DirNotifier | None = None
        self._dirs: list[Path] = []
        if isinstance(storage, LocalStorage) and sleep is time.sleep:
            self._dirs = [storage.root, storage.root / "tags"] if tags else [storage.root]

    def start(self) -> None:
        """Watch the directories before the feed's first look (a commit right after that look wakes the first
        wait); called when iteration starts, so a feed never iterated holds no descriptor."""
        if self._dirs:
            self._notifier = dir_notifier(self._dirs)
            if self._notifier is None:
                self._dirs = []  # no inotify here: poll

    def __call__(self, seconds: float) -> None:
        if self._notifier is None:
            self._sleep(seconds)
            return
        for directory in self._dirs[1:]:  # tags/ may have been made since the last look
            self._notifier.add(directory)
        self._notifier.wait(seconds)

    def close(self) -> None:
        if self._notifier is not None:
            self._notifier.close()


def _closing(items: Iterator[CheckpointInfo], wait: _Waiter) -> Iterator[CheckpointInfo]:
    """``items``, then the waiter's descriptor closed (the iteration ended, or the caller closed the feed)."""
    try:
        wait.start()
        yield from items
    finally:
        wait.close()


def _leased(info: CheckpointInfo, lease: ReadLease | None) -> Iterator[CheckpointInfo]:
    """Yield ``info`` while ``lease`` holds its step: until the consumer asks for the next one, or closes the
    feed (another process's retention keeps the checkpoint meanwhile)."""
    try:
        yield info
    finally:
        if lease is not None:
            lease.release()


def _commits(
    catalog: Catalog, last: int | None, poll_s: float, timeout_s: float | None, wait: _Waiter
) -> Iterator[CheckpointInfo]:
    """Yield each checkpoint committed with a step greater than ``last`` (every one when None)."""
    waited_since = time.monotonic()
    while True:
        fresh = [s for s in catalog.steps() if last is None or s > last]
        for step in fresh:
            try:
                info = catalog.info(step)
                lease = catalog.leases.take(step)  # held while the consumer handles it (until the next look)
            except (CheckpointNotFoundError, FormatError):  # deleted by retention, or unreadable: not ours
                continue
            last = step
            waited_since = time.monotonic()
            yield from _leased(info, lease)
        if timeout_s is not None and time.monotonic() - waited_since >= timeout_s:
            return
        wait(poll_s)


def _tag_moves(
    catalog: Catalog,
    name: str,
    seen: tuple[int, str] | None,
    poll_s: float,
    timeout_s: float | None,
    wait: _Waiter,
) -> Iterator[CheckpointInfo]:
    """Yield the checkpoint the movable tag ``name`` points to each time it changes (step or checkpoint) from
    ``seen``, the (step, manifest hash) it pointed to when the watch began (None: yield where it points)."""
    waited_since = time.monotonic()
    while True:
        tag = catalog.tags.get(name)  # one atomic object: never a half-moved tag
        if tag is not None and (tag.step, tag.manifest_sha256) != seen:
            lease: ReadLease | None = None
            try:
                lease = catalog.leases.take(tag.step)
                catalog.tags.resolve(name)  # still the tagged checkpoint (not deleted and saved again)
                info = catalog.info(tag.step)
            except (CheckpointNotFoundError, FormatError):
                info = None  # moved again or its step gone: the next look decides
                if lease is not None:
                    lease.release()
            if info is not None:
                seen = (tag.step, tag.manifest_sha256)
                waited_since = time.monotonic()
                yield from _leased(info, lease)
                continue
        if timeout_s is not None and time.monotonic() - waited_since >= timeout_s:
            return
        wait(poll_s)
