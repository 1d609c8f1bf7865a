"""How often to save: Young's and Daly's optimal intervals, the expected goodput and the interval plan.

Scope: Young's interval ``sqrt(2 C M)`` and Daly's higher-order interval (:func:`young_interval_s`,
:func:`daly_interval_s`), the expected goodput with restart time under Daly's complete model
(:func:`expected_goodput`), and the period a job should use, from the optimum or fixed by hand, with its
checkpoints per day and per MTTF (:func:`plan_interval`).

Anti-scope: the failure model itself (:mod:`tiersave.planner.failures`), what the tiers must sustain
(:mod:`tiersave.planner.bandwidth`), the policies a training loop asks at run time
(:mod:`tiersave.planner.schedule`); no I/O, no clocks.

Vocabulary used throughout: the checkpoint *cost* ``C`` is the time a save blocks training; the *interval*
is the compute time between the end of one save's blocking part and the start of the next (the ``tau`` of
Young and Daly); the *period* is save start to save start, ``interval + C``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from ..errors import ConfigError
from ..units import SECONDS_PER_DAY, format_duration
from ._checks import require_non_negative, require_positive
from .failures import FailureModel

__all__ = [
    "Formula",
    "IntervalPlan",
    "daly_interval_s",
    "expected_goodput",
    "optimal_interval_s",
    "plan_interval",
    "young_interval_s",
]


class Formula(str, Enum):
    """Which optimum to use for the checkpoint interval."""

    YOUNG = "young"
    DALY = "daly"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Formula | str) -> Formula:
        """``value`` as a :class:`Formula`, case-insensitive.

        Raises:
            ConfigError: neither ``"young"`` nor ``"daly"``.
        """
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ConfigError(f"unknown interval formula {value!r}; choose young or daly") from None


def young_interval_s(cost_s: float, mttf_s: float) -> float:
    """Young's (1974) first-order optimal compute interval between checkpoints, ``sqrt(2 C M)``.

    Args:
        cost_s: ``C``, the time one checkpoint costs the job (blocked time).
        mttf_s: ``M``, the job's mean time between failures.

    Raises:
        ConfigError: ``cost_s < 0`` or ``mttf_s <= 0``.

    Example::

        >>> young_interval_s(2.0, 3600.0)
        120.0
    """
    cost = require_non_negative("checkpoint cost", cost_s)
    mttf = require_positive("MTTF", mttf_s)
    return math.sqrt(2.0 * cost * mttf)


def daly_interval_s(cost_s: float, mttf_s: float) -> float:
    """Daly's (2006) higher-order optimal compute interval.

    ``sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` while ``C < 2M``, and ``M`` once the
    checkpoint costs twice the MTTF or more (checkpointing more often than failures then only adds cost).

    Raises:
        ConfigError: ``cost_s < 0`` or ``mttf_s <= 0``.
    """
    cost = require_non_negative("checkpoint cost", cost_s)
    mttf = require_positive("MTTF", mttf_s)
    if cost >= 2.0 * mttf:
        return mttf
    ratio = cost / (2.0 * mttf)
    return math.sqrt(2.0 * cost * mttf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost


def optimal_interval_s(cost_s: float, mttf_s: float, formula: Formula | str = Formula.DALY) -> float:
    """The optimal compute interval by ``formula`` (``"young"`` or ``"daly"``)."""
    chosen = Formula.parse(formula)
    return young_interval_s(cost_s, mttf_s) if chosen is Formula.YOUNG else daly_interval_s(cost_s, mttf_s)


def expected_goodput(interval_s: float, cost_s: float, mttf_s: float, restart_s: float = 0.0) -> float:
    """Expected fraction of wall time spent on useful compute, under exponential failures.

    Daly's complete model: a segment of ``tau`` compute plus a checkpoint of ``C`` takes on average
    ``M * exp(R / M) * (exp((tau + C) / M) - 1)`` seconds when every failure costs the restart time ``R``
    plus the work since the last checkpoint, and failures may also strike during checkpoints and restarts.
    To first order the waste is ``C / (tau + C) + (tau + C) / 2M + R / M``.

    Args:
        interval_s: ``tau``, compute time between checkpoints.
        cost_s: ``C``, time one checkpoint blocks the job.
        mttf_s: ``M``, the job's MTTF.
        restart_s: ``R``, time from a failure until training runs again (detect, reschedule, load).

    Returns:
        A fraction in ``[0, 1)``; ``1 - goodput`` is the expected waste.

    Raises:
        ConfigError: a negative time or ``mttf_s <= 0``.
    """
    tau = require_non_negative("interval", interval_s)
    cost = require_non_negative("checkpoint cost", cost_s)
    mttf = require_positive("MTTF", mttf_s)
    restart = require_non_negative("restart time", restart_s)
    if tau == 0:
        return 0.0
    try:
        segment = mttf * math.exp(restart / mttf) * math.expm1((tau + cost) / mttf)
    except OverflowError:  # the segment almost never completes
        return 0.0
    return tau / segment


@dataclass(frozen=True, kw_only=True, slots=True)
class IntervalPlan:
    """How often to checkpoint a job and what it costs in goodput.

    Attributes:
        failure: the failure model.
        cost_s: ``C``, time a save blocks training, when known.
        restart_s: ``R``, time from a failure until training runs again.
        young_interval_s: Young's optimum, when ``C`` is known.
        daly_interval_s: Daly's optimum, when ``C`` is known.
        interval_s: the chosen compute time between saves, when ``C`` is known.
        period_s: the chosen time from save start to save start.
        chosen_by: how the period was chosen, e.g. ``"daly"`` or ``"20 per MTTF"``.
        goodput: expected useful fraction of wall time at the chosen interval, when ``C`` is known.
    """

    failure: FailureModel
    cost_s: float | None
    restart_s: float
    young_interval_s: float | None
    daly_interval_s: float | None
    interval_s: float | None
    period_s: float
    chosen_by: str
    goodput: float | None

    def __post_init__(self) -> None:
        require_positive("checkpoint period", self.period_s)

    @property
    def checkpoints_per_day(self) -> float:
        """Checkpoints started per day, ``86400 / period``."""
        return SECONDS_PER_DAY / self.period_s

    @property
    def checkpoints_per_mttf(self) -> float:
        """Checkpoints between two failures on average."""
        return self.failure.cluster_mttf_s / self.period_s


def plan_interval(
    failure: FailureModel,
    *,
    cost_s: float | None = None,
    restart_s: float = 0.0,
    formula: Formula | str = Formula.DALY,
    period_s: float | None = None,
    checkpoints_per_mttf: float | None = None,
) -> IntervalPlan:
    """Choose the checkpoint period for a job: the Young/Daly optimum, or a period given directly.

    Args:
        failure: the job's failure model.
        cost_s: ``C``, the time a save blocks training; needed for the optimum and the goodput.
        restart_s: ``R``, the time from a failure until training runs again.
        formula: the optimum to choose when no period is given.
        period_s: use this save-to-save period instead of the optimum.
        checkpoints_per_mttf: use ``cluster MTTF / checkpoints_per_mttf`` as the period.

    Raises:
        ConfigError: both or neither of ``cost_s`` and a fixed period, or a ``cost_s`` at least as long as
            the fixed period, or non-positive inputs.

    Example::

        >>> f = FailureModel.from_cluster_mttf(124 * 60.0, 24_000)
        >>> round(plan_interval(f, checkpoints_per_mttf=20).checkpoints_per_day, 1)
        232.3
    """
    mttf = failure.cluster_mttf_s
    restart = require_non_negative("restart time", restart_s)
    cost = None if cost_s is None else require_non_negative("checkpoint cost", cost_s)
    chosen = Formula.parse(formula)
    if period_s is not None and checkpoints_per_mttf is not None:
        raise ConfigError("give a fixed period or a number of checkpoints per MTTF, not both")
    young = daly = None
    if cost is not None:
        young, daly = young_interval_s(cost, mttf), daly_interval_s(cost, mttf)
    if checkpoints_per_mttf is not None:
        period = mttf / require_positive("checkpoints per MTTF", checkpoints_per_mttf)
        chosen_by = f"{checkpoints_per_mttf:g} per MTTF"
    elif period_s is not None:
        period = require_positive("checkpoint period", period_s)
        chosen_by = "fixed period"
    elif cost is not None and young is not None and daly is not None:
        interval = young if chosen is Formula.YOUNG else daly
        if interval == 0:
            raise ConfigError("a checkpoint cost of 0 s makes the optimal interval 0: give the measured cost")
        period = interval + cost
        chosen_by = chosen.value
    else:
        raise ConfigError(
            "the optimal interval needs the checkpoint cost (time a save blocks training); "
            "or fix the period, or the number of checkpoints per MTTF"
        )
    interval_s: float | None = None
    goodput: float | None = None
    if cost is not None:
        if cost >= period:
            raise ConfigError(
                f"a checkpoint costing {format_duration(cost)} does not fit in a period of "
                f"{format_duration(period)}: training would never run"
            )
        interval_s = period - cost
        goodput = expected_goodput(interval_s, cost, mttf, restart)
    return IntervalPlan(
        failure=failure,
        cost_s=cost,
        restart_s=restart,
        young_interval_s=young,
        daly_interval_s=daly,
        interval_s=interval_s,
        period_s=period,
        chosen_by=chosen_by,
        goodput=goodput,
    )
