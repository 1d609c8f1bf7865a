"""Removing the files of deleted checkpoints off the commit thread.

Scope: a file-system tier deletes a checkpoint in two steps (leases.delete_committed): it renames the step's
directory to a trash name, which un-commits it atomically (no reader finds it from then on, and no listing
shows it), then removes the files. The removal costs about what the save's ``fsync`` costs (ext4 frees the
extents of a 1 GiB checkpoint in 0.3-0.9 s on the benchmark machine, docs/benchmarks.md "The buffered save,
2026-11-24"), and a blocking ``save()``, which waits for its first tier's retention, paid it. A
:class:`Reclaimer` runs the removals of the first tier's retention after each commit on a thread of its own:
``save()`` returns once the old checkpoint is renamed away; ``Checkpointer.wait()`` and ``close()`` wait for
the removals (the reclaimer is one of the chain's companions). A process that dies first leaves a trash
directory, which the next retention's leftovers pass removes (a trash name is always an interrupted delete).

Anti-scope: what retention deletes (policy.py, catalog.py); the rename (leases.py); object stores, which
delete the commit marker and then the files in one go (no rename there to separate the two).
"""

from __future__ import annotations

import builtins
import threading
from typing import TYPE_CHECKING, Any

from .engine.pool import DaemonThreadPool
from .errors import ClosedError
from .events import background_warning

if TYPE_CHECKING:
    from .handle import SaveHandle
    from .storage.base import Storage


class Reclaimer:
    """One thread that removes renamed-away checkpoint directories, in the order they were deleted."""

    def __init__(self) -> None:
        self._pool = DaemonThreadPool(1, "tiersave-reclaim")
        self._lock = threading.Lock()
        self._pending: set[tuple[str, str]] = set()  # a later leftovers pass lists them too: once is enough

    def later(self, storage: Storage, name: str) -> None:
        """Remove ``name`` (a trash directory, already invisible to readers) of ``storage`` on the thread."""
        key = (storage.uri, name)
        with self._lock:
            if key in self._pending:
                return
            self._pending.add(key)
        try:
            self._pool.submit(self._remove, storage, name, key)
        except ClosedError:  # closed with a save still in flight (close's timeout): remove it now
            self._remove(storage, name, key)

    def _remove(self, storage: Storage, name: str, key: tuple[str, str]) -> None:
        try:
            storage.delete_prefix(name)
        except Exception as exc:  # the checkpoint is deleted already; only its space is not yet free
            background_warning(f"removing {name} in {storage.uri} failed: {exc}; the next retention removes it")
        finally:
            with self._lock:
                self._pending.discard(key)

    def after_commit(self, handle: SaveHandle, chain: object) -> None:
        """Nothing: the reclaimer only runs what retention hands it."""

    def pools(self) -> builtins.list[DaemonThreadPool]:
        return [self._pool]

    def follow_up(self, first: Any) -> str:
        return f"the removal of deleted checkpoints' files from {first.storage.uri} (a later retention does it)"

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)
