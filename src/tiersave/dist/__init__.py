"""Coordination between the ranks of a ``torch.distributed`` job: the layer a collective save stands on.

Scope: a gloo group of tiersave's own (:class:`CoordinationGroup`), each rank's node identity, bounded JSON
exchanges (gather, broadcast, all-gather, agreement, a shared nonce) and the two-phase commit decision
(:meth:`CoordinationGroup.vote`). Every call is one gather to rank 0 plus one broadcast from it, carries
JSON (never pickle), has a deadline, and fails on every rank with the same
:class:`~tiersave.errors.DistributedCheckpointError` naming the failing ranks.

Anti-scope: shard writing, manifests, storage, restore, resharding: the checkpointer and the DCP backend
use this layer; it knows nothing about them.

Typical use on every rank (``torch.distributed.init_process_group`` already called)::

    group = CoordinationGroup(timeout_s=300)          # collective: every rank, same order
    prefix = f"step-{step}.tmp-{group.nonce}"          # same name on every rank, no collective
    try:
        entries = write_my_shards(prefix)              # this rank's part, made durable
    except Exception as exc:
        group.vote(step, error=exc)                    # a no vote: always raises, on every rank
    outcome = group.vote(step, entries, commit=write_global_manifest)  # runs on rank 0 only if all said yes

See ``group.py`` for deadlines, thread safety and failure semantics, ``vote.py`` for the commit protocol.
"""

from __future__ import annotations

from .group import CoordinationGroup, NodeIdentity
from .vote import CommitCallback, CommitOutcome
from .wire import Json, RemoteRankError

__all__ = ["CommitCallback", "CommitOutcome", "CoordinationGroup", "Json", "NodeIdentity", "RemoteRankError"]
