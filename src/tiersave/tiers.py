"""Tiers: where checkpoints go, how often, how many are kept, and how they drain down the chain.

A ``Checkpointer`` owns an ordered chain of tiers, fastest first, e.g.::

    Checkpointer(tiers=[
        Tier("mem://run1", keep=2),                       # every save, in RAM; survives a process crash
        Tier("/local/ckpt", every=5, keep="last=3"),      # every 5th save, on the node's disk
        Tier("s3://bucket/run1?endpoint=...", every=20, keep="last=5,every=10000,best=2:loss:min"),
    ])

The first tier receives every save (it is where staging writes). Every later tier receives the saves its
cadence selects (``every`` N-th save, or at most one per ``every_s`` seconds), copied in the background
from the first tier by that tier's own drain thread, verified chunk by chunk and committed with the
tier's own commit protocol; each tier acknowledges a checkpoint only once it is durable there. A tier
whose drain takes longer than the saves arrive gets every N-th checkpoint instead (a warning says so),
never an ever-growing queue. Retention runs per tier after each commit there and never deletes a
checkpoint that a drain or a restore is reading, nor the newest checkpoint durable on that tier.

Scope: the tier model and its per-tier runtime state. Anti-scope: moving bytes (engine/copy.py), what
to keep (policy.py), the save and restore orchestration (checkpointer.py).
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from .catalog import Catalog
from .commit import CommitStrategy, commit_for
from .engine.pool import DaemonThreadPool
from .errors import ConfigError
from .policy import KeepLast, RetentionPolicy, parse_policy
from .storage import open_storage
from .storage.base import Storage

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Future

__all__ = ["Tier"]

DEFAULT_VOLATILE_KEEP = 2
"""Checkpoints a non-durable tier (RAM) keeps when its ``keep`` is not given: bounded memory by default."""


@dataclass(frozen=True)
class Tier:
    """One tier of a checkpoint chain.

    Args:
        uri: a path, ``file://``, ``mem://NAME``, ``s3://bucket/prefix?...`` URI, or a ``Storage``.
        name: how the tier is named in handles, listings and messages (default: derived from the URI).
        every: send every N-th save to this tier (the first tier must take every save).
        every_s: instead of ``every``: send a save when at least this many seconds passed since the last
            one sent to this tier.
        keep: retention on this tier: an int (keep the last N), a spec such as
            ``"last=3,every=1000,best=2:loss:min,tag=milestone"``, or a policy from ``tiersave.policy``.
            Default: the Checkpointer's ``keep_last``, or keep 2 on a non-durable (memory) tier.
        io: for a local path, ``"auto"``, ``"direct"`` or ``"buffered"`` I/O (None: ``TIERSAVE_IO``, else
            auto, which calibrates once per file system).
    """

    uri: str | os.PathLike[str] | Storage
    name: str | None = None
    every: int = 1
    every_s: float | None = None
    keep: RetentionPolicy | int | str | None = None
    io: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"Tier every must be a positive integer, got {self.every!r}")
        if self.every_s is not None:
            if not (isinstance(self.every_s, (int, float)) and math.isfinite(self.every_s) and self.every_s > 0):
                raise ConfigError(f"Tier every_s must be a positive number of seconds, got {self.every_s!r}")
            if self.every != 1:
                raise ConfigError("give a Tier either every (saves) or every_s (seconds), not both")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ConfigError(f"Tier name must be a non-empty string, got {self.name!r}")


def to_policy(keep: RetentionPolicy | int | str | None) -> RetentionPolicy | None:
    if keep is None:
        return None
    if isinstance(keep, bool):
        raise ConfigError(f"keep must be an int, a spec string or a retention policy, got {keep!r}")
    if isinstance(keep, int):
        return KeepLast(keep)
    if isinstance(keep, str):
        return parse_policy(keep)
    if callable(getattr(keep, "keep", None)):
        return keep
    raise ConfigError(f"keep must be an int, a spec string or a retention policy, got {keep!r}")


def default_name(uri: str | os.PathLike[str] | Storage, storage: Storage) -> str:
    if isinstance(uri, str) and "://" in uri:
        scheme = urlparse(uri).scheme.lower()
        return {"mem": "memory", "file": "local", "s3": "s3"}.get(scheme, scheme)
    return "memory" if not storage.capabilities.durable else "local"


class TierRuntime:
    """A tier in use: its storage, catalog, commit protocol, policy and drain state."""

    def __init__(self, spec: Tier, index: int, *, default_keep: int | None, io_threads: int) -> None:
        self.spec = spec
        self.index = index
        self.storage: Storage = open_storage(spec.uri, io=spec.io)
        self.name = spec.name or default_name(spec.uri, self.storage)
        self.catalog = Catalog(self.storage)
        self.commit: CommitStrategy = commit_for(self.storage)
        policy = to_policy(spec.keep)
        if policy is None and default_keep is not None:
            policy = KeepLast(default_keep)
        if policy is None and not self.storage.capabilities.durable:
            policy = KeepLast(DEFAULT_VOLATILE_KEEP)
        self.policy = policy
        self.io_threads = io_threads
        self.sent = 0
        self.considered = 0
        self.last_sent_mono: float | None = None
        self.widened_every = 1
        self.last_drain_s = 0.0
        self.skipped = 0
        self.busy: Future[object] | None = None
        self.drainer: DaemonThreadPool | None = None
        self.copier: DaemonThreadPool | None = None
        if index > 0:
            self.drainer = DaemonThreadPool(1, f"tiersave-drain-{self.name}")
            self.copier = DaemonThreadPool(io_threads, f"tiersave-copy-{self.name}")

    @property
    def every(self) -> int:
        """The cadence in use: the configured one, widened when the drain cannot keep up."""
        return max(self.spec.every, self.widened_every)

    def due(self, now_mono: float) -> bool:
        """Whether the save being committed now goes to this tier (advances the save counter)."""
        self.considered += 1
        if self.index == 0:
            return True
        if self.spec.every_s is not None:
            interval = self.spec.every_s * self.widened_every
            return self.last_sent_mono is None or now_mono - self.last_sent_mono >= interval
        return self.considered % self.every == 0

    def shutdown(self, wait: bool) -> None:
        for pool in (self.drainer, self.copier):
            if pool is not None:
                pool.shutdown(wait=wait)


class Protection:
    """Steps that retention must not delete, per tier: being drained from, or being restored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, Counter[int]] = {}

    def hold(self, tier: int, step: int) -> None:
        with self._lock:
            self._held.setdefault(tier, Counter())[step] += 1

    def release(self, tier: int, step: int) -> None:
        with self._lock:
            counter = self._held.get(tier)
            if counter is not None:
                counter[step] -= 1
                if counter[step] <= 0:
                    del counter[step]

    def steps(self, tier: int) -> frozenset[int]:
        with self._lock:
            return frozenset(self._held.get(tier, ()))


def check_chain(tiers: list[TierRuntime]) -> None:
    """Validate a chain: a first tier that takes every save, distinct names and locations."""
    if not tiers:
        raise ConfigError("a Checkpointer needs at least one tier (a root path or tiers=[...])")
    first = tiers[0].spec
    if first.every != 1 or first.every_s is not None:
        raise ConfigError(f"the first tier ({tiers[0].name}) receives every save; give cadences to later tiers")
    names = [t.name for t in tiers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"tier names must differ; name them with Tier(..., name=...): {', '.join(duplicates)}")
    uris = [t.storage.uri for t in tiers]
    if len(set(uris)) != len(uris):
        raise ConfigError("two tiers point at the same place; each tier needs its own location")
