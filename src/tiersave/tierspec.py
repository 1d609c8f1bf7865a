"""The tier model: one tier's configuration (:class:`Tier`) as a user writes it, checked when it is made, and
what its ``keep`` and URI turn into (a retention policy, a default name).

Scope: the ``Tier`` dataclass, its argument checks, ``keep`` -> policy, the default tier name. Anti-scope: a
tier in use and the chain at run time (tiers.py), the policies themselves (policy.py), drain options' checks
(drain_refs.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from urllib.parse import urlparse

from .drain_refs import check_drain_options
from .errors import ConfigError
from .policy import KeepLast, RetentionPolicy, parse_policy
from .storage.base import Storage

__all__ = ["Tier", "default_name", "to_policy"]


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
        replicas: for the first tier, a memory tier (``mem://NAME``) of a job on several nodes: hold each
            node's part of every checkpoint in the memory of this many other nodes too, so that a lost node's
            replacement restores from a peer's RAM (docs/tiers.md, "Peer-memory replicas").
        failure_domain: with ``replicas``, this node's failure domain (e.g. its rack): replicas go to nodes of
            other domains first. None: ``TIERSAVE_FAILURE_DOMAIN``, else every node is its own domain.
        compress: a later tier's drains write zstd-compressed shards (``"zstd"``), only where measured to pay
            (``"auto"``), or plain ones (None); needs ``tiersave[zstd]`` (docs/tiers.md, "Compression").
        incremental, full_every: a later tier's drains reference the shards equal to its newest checkpoint's
            instead of copying them; a full drain every ``full_every`` (docs/tiers.md, "Incremental tiers").
    """

    uri: str | os.PathLike[str] | Storage
    name: str | None = None
    every: int = 1
    every_s: float | None = None
    keep: RetentionPolicy | int | str | None = None
    io: str | None = None
    replicas: int = 0
    failure_domain: str | None = None
    compress: str | None = None
    incremental: bool = False
    full_every: int | None = None

    def __post_init__(self) -> None:
        check_drain_options(self.compress, self.incremental, self.full_every)
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise ConfigError(f"Tier replicas must be a non-negative integer, got {self.replicas!r}")
        if self.failure_domain is not None and (
            not isinstance(self.failure_domain, str) or not self.failure_domain.strip()
        ):
            raise ConfigError(f"Tier failure_domain must be a non-empty string, got {self.failure_domain!r}")
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
