"""The two-phase commit decision across ranks, independent of storage.

Scope: what a vote says, how rank 0 decides from the votes, and what every rank gets back. The exchange
that carries votes and outcomes is :meth:`CoordinationGroup.vote <tiersave.dist.group.CoordinationGroup.vote>`
(one gather, one broadcast per save).

Anti-scope: writing shards or manifests (the caller's ``commit`` callback does that on rank 0), cleaning up
after an aborted save, retention.

Protocol, per save of step ``N`` (every rank, in the same order as its other coordination calls):

1. Each rank makes its own shards durable, then votes: yes with a JSON payload describing what it wrote, or
   no with the exception that stopped it.
2. Rank 0 gathers the votes. It decides *commit* only if every rank sent a vote in time, every vote is yes
   and every vote names step ``N``.
3. Only then rank 0 runs the ``commit`` callback with the payloads by rank (it writes the global manifest,
   which makes the checkpoint visible). If the callback raises, the save failed.
4. Rank 0 sends the outcome to every rank: every rank returns the same :class:`CommitOutcome` or raises the
   same :class:`~tiersave.errors.DistributedCheckpointError`, naming the failing ranks with their errors.

What callers may rely on: ``commit`` runs at most once, on rank 0, and never when any rank voted no, voted
for another step, or did not vote in time. What they cannot know: if rank 0 dies or hangs after step 3,
the other ranks raise (naming rank 0) without knowing whether the checkpoint became visible; whoever restores
next looks for it, as after any crash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError
from .wire import Decline, Json, failure_report, report_error

__all__ = ["CommitCallback", "CommitOutcome", "decide_votes", "vote_document"]

CommitCallback = Callable[[list[Json]], Json]
"""Rank 0's commit action: receives every rank's yes-vote payload, by rank; returns a small JSON result."""


@dataclass(frozen=True)
class CommitOutcome:
    """The result of a committed vote, the same on every rank.

    Attributes:
        step: the committed step.
        result: what rank 0's commit callback returned (None without a callback).
        world_size: the number of ranks that voted.
    """

    step: int
    result: Json
    world_size: int


def vote_document(step: int, payload: Json, error: BaseException | None) -> tuple[Json, BaseException | None]:
    """This rank's vote as a JSON document, plus an error to send instead when the vote itself is unusable."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None, ConfigError(f"vote: step must be a non-negative int, got {step!r}")
    if error is not None:
        return {"step": step, "ok": False, "payload": None, "error": report_error(error)}, None
    return {"step": step, "ok": True, "payload": payload, "error": None}, None


def decide_votes(step: int, docs: list[Json], commit: CommitCallback | None) -> Json:
    """Rank 0's decision: commit only if every rank voted yes for ``step``; then run ``commit``.

    Raises:
        Decline: with the failure report naming each rank that voted no or for another step.
    """
    failures: dict[int, dict[str, Json]] = {}
    said_no: list[int] = []
    other_step: list[int] = []
    for rank, doc in enumerate(docs):
        if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
            failures[rank] = report_error(ValueError(f"rank {rank} sent a vote of unknown shape"))
            other_step.append(rank)
        elif doc.get("step") != step:
            failures[rank] = report_error(
                ValueError(f"rank {rank} voted for step {doc.get('step')!r} while rank 0 voted for step {step}")
            )
            other_step.append(rank)
        elif not doc["ok"]:
            err = doc.get("error")
            failures[rank] = err if isinstance(err, dict) else report_error(RuntimeError(str(err)))
            said_no.append(rank)
    if failures:
        parts = []
        if said_no:
            kinds = sorted({str(failures[r].get("type")) for r in said_no})
            who = ("rank " if len(said_no) == 1 else "ranks ") + ", ".join(map(str, said_no))
            parts.append(f"{who} voted no ({', '.join(kinds)})")
        if other_step:
            who = ("rank " if len(other_step) == 1 else "ranks ") + ", ".join(map(str, other_step))
            parts.append(f"{who} did not vote for step {step}")
        raise Decline(
            failure_report(
                op="vote",
                phase="decide",
                step=step,
                summary="; ".join(parts) + "; nothing was committed",
                failures=failures,
                poison=False,
            )
        )
    result = commit([doc.get("payload") if isinstance(doc, dict) else None for doc in docs]) if commit else None
    return {"result": result}
