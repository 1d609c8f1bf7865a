"""The exchanges of a collective restore: the ranks agree on each copy they read, and once more after loading.

Every rank of a collective restore tries rank 0's list of copies in the same order (restore.py) and reads its
part of one. :func:`agree_on_copy` is the one exchange after that read: every rank learns whether every rank
could use the copy (else all move on to the next copy together), whether a rank failed for a reason that is not
the copy's (then every rank raises), and, where the ranks of a machine split the checks of the replicated state
(splitverify.py), whether every share verified.

A rank whose checks were split loads its live state only after that agreement, so that nothing changes before
the other ranks vouched for the bytes it read unchecked. That load can still fail on one rank (a shape a
module's ``load_state_dict`` refuses, a copy onto a device failing). :func:`finish_together` loads the state and
the ranks exchange once more: a failure on any rank makes every rank raise, instead of the others returning and
then waiting for that rank at the job's next collective. Ranks that loaded their state before the agreement
(every byte checked by themselves) report a failure of that load in the agreement itself.

Scope: the documents exchanged after reading a copy and after loading it, and the errors every rank raises from
them. Anti-scope: choosing and reading the copies, the fallback rules (restore.py), what a split rank reads
unchecked (splitverify.py), the exchange itself and its timeout (dist/).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from . import splitverify
from .dist.wire import error_from_report, rank_list, report_error
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FormatError,
    StorageError,
    TiersaveError,
)

if TYPE_CHECKING:  # pragma: no cover
    from .dist import CoordinationGroup, Json


class Restore(Protocol):
    """What these exchanges need of one rank's read of a copy (``restore.Restore``, which imports this module)."""

    split: splitverify.Split | None

    def finish(self) -> tuple[Any, int, int]: ...  # once: a later call returns the first call's result

    def verify_unchecked(self) -> None: ...


def agree_on_copy(
    group: CoordinationGroup, step: int, error: Exception | None, job: Restore | None = None
) -> tuple[TiersaveError | None, bool]:
    """Every rank learns whether every rank could use this copy.

    Args:
        group: the restore's coordination group.
        step: the step of the copy.
        error: this rank's failure reading (or loading) the copy, if any.
        job: this rank's read of the copy, whose split checks (splitverify.py) the same exchange confirms;
            where a split did not hold, every rank checks what it read unchecked and the ranks agree once more.

    Returns:
        ``(error, deferred)``: this rank's error about the copy, or the error naming the ranks that could not use
        it (None: every rank can); ``deferred``: some rank loads its live state only now (its checks were
        split), so every rank must call :func:`finish_together` (the same on every rank).

    Raises:
        DistributedCheckpointError: on every rank but the failing ones, when a rank failed for a reason that is
            not the copy's (a live state that does not fit, a bug); the failing rank raises its own error.
    """
    mine: Json = None
    if error is not None:
        mine = {**report_error(error), "copy": _copy_error(error)}
    split = job.split if job is not None else None
    if split is not None:
        mine = {"split": split.document()}
    reports = group.all_gather_json(mine, step=step)
    splits = [splitverify.split_of(rep) for rep in reports]
    deferred = any(s is not None for s in splits)
    failed = {r: rep for r, rep in enumerate(reports) if rep is not None and splits[r] is None}
    if not failed:
        if not splitverify.fallback_needed(splits):
            return None, deferred
        mine_error: Exception | None = None
        if job is not None and not splitverify.holds(splits, group.rank):
            try:
                job.verify_unchecked()
            except Exception as exc:  # any kind: the other ranks learn it in the exchange, not by their timeout
                mine_error = exc
        return agree_on_copy(group, step, mine_error)[0], deferred
    fatal = {r: rep for r, rep in failed.items() if isinstance(rep, dict) and not rep.get("copy")}
    if fatal:
        if error is not None and not _copy_error(error):
            raise error
        raise _ranks_failed(step, "failed", fatal)
    if error is not None:
        assert isinstance(error, TiersaveError)  # a copy error
        return error, deferred
    ranks = ", ".join(str(r) for r in failed)
    first = next(iter(failed.values()))
    message = first.get("message") if isinstance(first, dict) else first
    return CorruptCheckpointError(f"rank(s) {ranks} could not use this copy: {message}", step=step), deferred


def finish_together(group: CoordinationGroup, step: int, job: Restore) -> tuple[Any, int, int]:
    """Load the live state (unless this rank did before the agreement), then learn whether every rank did.

    Returns:
        ``job.finish()``'s result: ``(result, bytes read, tensors read in place)``.

    Raises:
        DistributedCheckpointError: on every rank but the failing ones when a rank's load failed, naming each
            such rank, the step and its error. A failing rank raises its own error (``StateMismatchError`` for a
            state that does not fit), as a failing rank does in a collective save. The other ranks' live state
            is loaded by then: the restore raised, so its content is not to be trusted.
    """
    failure: Exception | None = None
    done: tuple[Any, int, int] | None = None
    try:
        done = job.finish()  # at once if this rank loaded before the agreement
    except Exception as exc:  # any failure: the other ranks must learn it here, not at the job's next collective
        failure = exc
    try:
        reports = group.all_gather_json(None if failure is None else report_error(failure), step=step)
    except DistributedCheckpointError:
        if failure is not None:
            raise failure from None  # this rank's own error says more than the exchange's
        raise
    if failure is not None:
        raise failure
    failed = {r: rep for r, rep in enumerate(reports) if isinstance(rep, dict)}
    if failed:
        raise _ranks_failed(step, "failed to load the restored state into its live state", failed)
    assert done is not None
    return done


def _ranks_failed(step: int, what: str, reports: Mapping[int, Any]) -> DistributedCheckpointError:
    """The error every other rank raises when ``reports`` (by rank) name failures: the ranks, the step, each error."""
    first = reports[min(reports)]
    return DistributedCheckpointError(
        f"restore of step {step}: {rank_list(sorted(reports))} {what}: {first.get('type')}: {first.get('message')}",
        {r: error_from_report(r, rep) for r, rep in reports.items()},
    )


def _copy_error(error: Exception) -> bool:
    """Whether ``error`` is about the copy read (missing, damaged, unreadable): the ranks try the next one."""
    return isinstance(error, (FormatError, CheckpointNotFoundError, StorageError))
