"""When to checkpoint: the failure model, the optimal interval, bandwidth needs and the schedule policies.

Scope:
    * Failure model: cluster MTTF from component counts and per-component MTTF (independent exponential
      failures, so rates add), or from an observed record (N interruptions over D days on G accelerators),
      scaled to another cluster size (:class:`FailureModel`).
    * Young's interval ``sqrt(2 C M)`` and Daly's higher-order interval, the expected goodput and waste with
      restart time (:func:`young_interval_s`, :func:`daly_interval_s`, :func:`expected_goodput`).
    * Checkpoints per day, bytes per day and the sustained write bandwidth per tier, overall and per
      accelerator, and whether a tier of a given bandwidth keeps up (:func:`plan_interval`,
      :func:`plan_bandwidth`).
    * The policies a :class:`~tiersave.Checkpointer` asks whether to save (:class:`Schedule`):
      :class:`EveryNSteps`, :class:`EverySeconds` and :class:`AutoSchedule`, which applies Young/Daly to the
      blocked time it measures and tells how far a slow tier's cadence must widen (``tier_every``).

Anti-scope: no I/O, no clocks of its own (callers pass ``now``), no threads, no torch; the checkpoint size
comes from :mod:`tiersave.sizing` or a measurement.

Vocabulary used throughout: the checkpoint *cost* ``C`` is the time a save blocks training; the *interval*
is the compute time between the end of one save's blocking part and the start of the next (the ``tau`` of
Young and Daly); the *period* is save start to save start, ``interval + C``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from ..errors import ConfigError
from ..units import SECONDS_PER_DAY, format_duration, parse_duration

__all__ = [
    "AutoSchedule",
    "BandwidthPlan",
    "Component",
    "EveryNSteps",
    "EverySeconds",
    "FailureModel",
    "Formula",
    "IntervalPlan",
    "SaveCost",
    "Schedule",
    "TierLoad",
    "TierSpec",
    "cluster_mttf_s",
    "daly_interval_s",
    "expected_goodput",
    "optimal_interval_s",
    "parse_schedule",
    "plan_bandwidth",
    "plan_interval",
    "tier_every_for",
    "young_interval_s",
]

# Two float computations of "the same" period differ in the last bits; a tier whose drain equals its
# period exactly keeps up.
_REL_TOL = 1e-9


def _require_positive(what: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def _require_non_negative(what: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def _require_count(what: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


# -------------------------------------------------------------------------------------------- failure model


@dataclass(frozen=True, kw_only=True, slots=True)
class Component:
    """A kind of part whose failure interrupts the job.

    Attributes:
        name: e.g. ``"gpu"``, ``"host"``, ``"nic"``.
        count: how many of them the job uses.
        mttf_s: mean time to failure of one of them, in seconds.
    """

    name: str
    count: int
    mttf_s: float

    def __post_init__(self) -> None:
        _require_count(f"component {self.name!r}: count", self.count)
        _require_positive(f"component {self.name!r}: MTTF", self.mttf_s)


def cluster_mttf_s(components: Iterable[Component]) -> float:
    """MTTF of a job that fails when any one component fails.

    With independent exponential failures the rates add: ``1 / M = sum(count_i / mttf_i)``.

    Raises:
        ConfigError: no components.

    Example::

        >>> cluster_mttf_s([Component(name="gpu", count=1000, mttf_s=1000 * 3600.0)])
        3600.0
    """
    rate = sum(c.count / c.mttf_s for c in components)
    if rate == 0:
        raise ConfigError("the failure model needs at least one component")
    return 1.0 / rate


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureModel:
    """Failures of a job on ``accelerators`` accelerators, as a per-accelerator MTTF.

    Keeping the rate per accelerator lets the same model be scaled to another cluster size: everything
    that fails (GPUs, hosts, links) is assumed to grow in proportion to the accelerators.

    Attributes:
        accelerators: accelerators in the job.
        accelerator_mttf_s: MTTF attributable to one accelerator (and its share of hosts, network...).
        source: how the figure was obtained, for reports.
    """

    accelerators: int
    accelerator_mttf_s: float
    source: str = ""

    def __post_init__(self) -> None:
        _require_count("accelerators", self.accelerators)
        _require_positive("MTTF per accelerator", self.accelerator_mttf_s)

    @property
    def cluster_mttf_s(self) -> float:
        """Mean time between job interruptions, ``accelerator_mttf_s / accelerators``."""
        return self.accelerator_mttf_s / self.accelerators

    @property
    def interruptions_per_day(self) -> float:
        """Expected interruptions per day of running."""
        return SECONDS_PER_DAY / self.cluster_mttf_s

    def scaled_to(self, accelerators: int) -> FailureModel:
        """The same per-accelerator failure rate on another number of accelerators."""
        if accelerators == self.accelerators:
            return self
        return FailureModel(
            accelerators=accelerators,
            accelerator_mttf_s=self.accelerator_mttf_s,
            source=f"{self.source}, scaled from {self.accelerators:,} to {accelerators:,} accelerators",
        )

    @classmethod
    def from_cluster_mttf(cls, mttf_s: float, accelerators: int) -> FailureModel:
        """A job on ``accelerators`` accelerators that is interrupted every ``mttf_s`` seconds on average.

        Raises:
            ConfigError: ``mttf_s <= 0`` or ``accelerators < 1``.
        """
        mttf = _require_positive("cluster MTTF", mttf_s)
        _require_count("accelerators", accelerators)
        return cls(
            accelerators=accelerators,
            accelerator_mttf_s=mttf * accelerators,
            source=f"cluster MTTF {format_duration(mttf)} on {accelerators:,} accelerators (given)",
        )

    @classmethod
    def from_accelerator_mttf(cls, mttf_s: float, accelerators: int) -> FailureModel:
        """Each accelerator (with its share of the rest) fails every ``mttf_s`` seconds on average."""
        mttf = _require_positive("MTTF per accelerator", mttf_s)
        return cls(
            accelerators=accelerators,
            accelerator_mttf_s=mttf,
            source=f"MTTF per accelerator {format_duration(mttf)} (given)",
        )

    @classmethod
    def from_record(
        cls, *, interruptions: int, days: float, accelerators: int, scale_to: int | None = None
    ) -> FailureModel:
        """The failure rate observed on a past run, optionally scaled to another cluster size.

        Args:
            interruptions: interruptions seen (the Llama 3 405B run saw 419 unexpected ones).
            days: how long the run was observed (54 days for that run).
            accelerators: accelerators it ran on (16,384).
            scale_to: the cluster size to plan for; the observed one when omitted.

        Raises:
            ConfigError: a non-positive count or duration.
        """
        _require_count("interruptions", interruptions)
        span = _require_positive("observed days", days)
        _require_count("observed accelerators", accelerators)
        observed = cls(
            accelerators=accelerators,
            accelerator_mttf_s=span * SECONDS_PER_DAY * accelerators / interruptions,
            source=f"{interruptions:,} interruptions in {span:g} days on {accelerators:,} accelerators (observed)",
        )
        return observed if scale_to is None else observed.scaled_to(scale_to)

    @classmethod
    def from_components(cls, components: Sequence[Component], accelerators: int) -> FailureModel:
        """A job built from ``components`` (counts for a job of ``accelerators`` accelerators).

        Raises:
            ConfigError: no components, or a non-positive count or MTTF.
        """
        mttf = cluster_mttf_s(components)
        _require_count("accelerators", accelerators)
        parts = ", ".join(f"{c.count:,} {c.name} x MTTF {format_duration(c.mttf_s)}" for c in components)
        return cls(
            accelerators=accelerators,
            accelerator_mttf_s=mttf * accelerators,
            source=f"components {parts} (independent exponential failures)",
        )


# ---------------------------------------------------------------------------------------- optimal interval


class Formula(str, Enum):
    """Which optimum to use for the checkpoint interval."""

    YOUNG = "young"
    DALY = "daly"

    def __str__(self) -> str:
        return self.value


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
    cost = _require_non_negative("checkpoint cost", cost_s)
    mttf = _require_positive("MTTF", mttf_s)
    return math.sqrt(2.0 * cost * mttf)


def daly_interval_s(cost_s: float, mttf_s: float) -> float:
    """Daly's (2006) higher-order optimal compute interval.

    ``sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` while ``C < 2M``, and ``M`` once the
    checkpoint costs twice the MTTF or more (checkpointing more often than failures then only adds cost).

    Raises:
        ConfigError: ``cost_s < 0`` or ``mttf_s <= 0``.
    """
    cost = _require_non_negative("checkpoint cost", cost_s)
    mttf = _require_positive("MTTF", mttf_s)
    if cost >= 2.0 * mttf:
        return mttf
    ratio = cost / (2.0 * mttf)
    return math.sqrt(2.0 * cost * mttf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost


def optimal_interval_s(cost_s: float, mttf_s: float, formula: Formula | str = Formula.DALY) -> float:
    """The optimal compute interval by ``formula`` (``"young"`` or ``"daly"``)."""
    chosen = _formula(formula)
    return young_interval_s(cost_s, mttf_s) if chosen is Formula.YOUNG else daly_interval_s(cost_s, mttf_s)


def _formula(value: Formula | str) -> Formula:
    try:
        return Formula(str(value).lower())
    except ValueError:
        raise ConfigError(f"unknown interval formula {value!r}; choose young or daly") from None


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
    tau = _require_non_negative("interval", interval_s)
    cost = _require_non_negative("checkpoint cost", cost_s)
    mttf = _require_positive("MTTF", mttf_s)
    restart = _require_non_negative("restart time", restart_s)
    if tau == 0:
        return 0.0
    try:
        segment = mttf * math.exp(restart / mttf) * math.expm1((tau + cost) / mttf)
    except OverflowError:  # the segment almost never completes
        return 0.0
    return tau / segment


def tier_every_for(drain_s: float, period_s: float) -> int:
    """The smallest ``N`` such that a tier whose drain takes ``drain_s`` keeps up with every N-th checkpoint.

    A tier that receives every N-th checkpoint has ``N * period_s`` to make each one durable before the
    next arrives, so ``N = ceil(drain_s / period_s)``, at least 1.

    Raises:
        ConfigError: ``drain_s < 0`` or ``period_s <= 0``.
    """
    drain = _require_non_negative("drain time", drain_s)
    period = _require_positive("checkpoint period", period_s)
    return max(1, math.ceil(drain / period * (1.0 - _REL_TOL)))


# -------------------------------------------------------------------------------------------------- plans


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
        _require_positive("checkpoint period", self.period_s)

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
    restart = _require_non_negative("restart time", restart_s)
    cost = None if cost_s is None else _require_non_negative("checkpoint cost", cost_s)
    chosen = _formula(formula)
    if period_s is not None and checkpoints_per_mttf is not None:
        raise ConfigError("give a fixed period or a number of checkpoints per MTTF, not both")
    young = daly = None
    if cost is not None:
        young, daly = young_interval_s(cost, mttf), daly_interval_s(cost, mttf)
    if checkpoints_per_mttf is not None:
        period = mttf / _require_positive("checkpoints per MTTF", checkpoints_per_mttf)
        chosen_by = f"{checkpoints_per_mttf:g} per MTTF"
    elif period_s is not None:
        period = _require_positive("checkpoint period", period_s)
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


@dataclass(frozen=True, kw_only=True, slots=True)
class TierSpec:
    """A storage tier as the planner sees it.

    Attributes:
        name: e.g. ``"memory"``, ``"local"``, ``"durable"``.
        every: the tier receives every ``every``-th checkpoint.
        bandwidth_bytes_per_s: the write bandwidth the job gets from this tier, when known.
    """

    name: str
    every: int = 1
    bandwidth_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        _require_count(f"tier {self.name!r}: every", self.every)
        if self.bandwidth_bytes_per_s is not None:
            _require_positive(f"tier {self.name!r}: bandwidth", self.bandwidth_bytes_per_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class TierLoad:
    """What one tier must sustain.

    Attributes:
        tier: the tier.
        checkpoints_per_day: checkpoints it receives per day.
        bytes_per_day: bytes written to it per day.
        required_bytes_per_s: sustained write bandwidth it needs, the whole job together.
        required_bytes_per_s_per_accelerator: the same divided among the accelerators.
        drain_s: time to write one checkpoint at the tier's bandwidth, when known.
        keeps_up: whether that drain fits in the time until its next checkpoint, when known.
        min_every: the smallest cadence at which it keeps up, when known.
    """

    tier: TierSpec
    checkpoints_per_day: float
    bytes_per_day: float
    required_bytes_per_s: float
    required_bytes_per_s_per_accelerator: float
    drain_s: float | None
    keeps_up: bool | None
    min_every: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class BandwidthPlan:
    """The write load of checkpointing ``checkpoint_bytes`` every ``period_s`` on each tier.

    Attributes:
        checkpoint_bytes: bytes in one checkpoint of the whole job.
        period_s: save start to save start.
        accelerators: accelerators sharing the load.
        tiers: the load on each tier.
    """

    checkpoint_bytes: int
    period_s: float
    accelerators: int
    tiers: tuple[TierLoad, ...]

    @property
    def checkpoints_per_day(self) -> float:
        """Checkpoints per day at this period."""
        return SECONDS_PER_DAY / self.period_s

    @property
    def bytes_per_day(self) -> float:
        """Bytes checkpointed per day (each checkpoint counted once, whatever the tiers)."""
        return self.checkpoint_bytes * self.checkpoints_per_day

    @property
    def bytes_per_s(self) -> float:
        """Sustained bandwidth to keep every checkpoint: one checkpoint per period."""
        return self.checkpoint_bytes / self.period_s

    @property
    def bytes_per_s_per_accelerator(self) -> float:
        """:attr:`bytes_per_s` divided among the accelerators."""
        return self.bytes_per_s / self.accelerators


def plan_bandwidth(
    checkpoint_bytes: int,
    period_s: float,
    accelerators: int,
    tiers: Sequence[TierSpec] = (),
) -> BandwidthPlan:
    """The bandwidth each tier needs to absorb a checkpoint of ``checkpoint_bytes`` every ``period_s``.

    Args:
        checkpoint_bytes: bytes in one checkpoint of the whole job.
        period_s: save start to save start.
        accelerators: accelerators sharing the load, for the per-accelerator figures.
        tiers: the tiers; one tier named ``"storage"`` that takes every checkpoint when empty.

    Raises:
        ConfigError: non-positive inputs.

    Example::

        >>> p = plan_bandwidth(4_870_000_000_000, 372.0, 24_000)
        >>> round(p.bytes_per_s / 1e9, 1)
        13.1
    """
    _require_count("checkpoint bytes", checkpoint_bytes)
    period = _require_positive("checkpoint period", period_s)
    _require_count("accelerators", accelerators)
    loads = []
    for tier in tiers or (TierSpec(name="storage"),):
        window = tier.every * period
        required = checkpoint_bytes / window
        drain = keeps_up = min_every = None
        if tier.bandwidth_bytes_per_s is not None:
            drain = checkpoint_bytes / tier.bandwidth_bytes_per_s
            min_every = tier_every_for(drain, period)
            keeps_up = min_every <= tier.every
        loads.append(
            TierLoad(
                tier=tier,
                checkpoints_per_day=SECONDS_PER_DAY / window,
                bytes_per_day=checkpoint_bytes * SECONDS_PER_DAY / window,
                required_bytes_per_s=required,
                required_bytes_per_s_per_accelerator=required / accelerators,
                drain_s=drain,
                keeps_up=keeps_up,
                min_every=min_every,
            )
        )
    return BandwidthPlan(
        checkpoint_bytes=checkpoint_bytes, period_s=period, accelerators=accelerators, tiers=tuple(loads)
    )


# ------------------------------------------------------------------------------------------------ policies


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveCost:
    """What one save cost, as the Checkpointer measured it.

    Attributes:
        step: the training step saved.
        blocked_s: time ``save()`` blocked the training loop (the cost ``C`` the job pays).
        drain_s: time until the checkpoint was durable on the slowest tier it was sent to (or, when the
            save is recorded before its own drain ends, that of the latest save whose drain has ended).
        wall_time: the clock reading when the save started, on the clock whose readings the caller passes
            to :meth:`Schedule.due` as ``now`` (``time.monotonic()`` for the Checkpointer).
    """

    step: int
    blocked_s: float
    drain_s: float
    wall_time: float

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ConfigError(f"SaveCost.step must be an integer >= 0, got {self.step!r}")
        _require_non_negative("SaveCost.blocked_s", self.blocked_s)
        _require_non_negative("SaveCost.drain_s", self.drain_s)
        if not math.isfinite(self.wall_time):
            raise ConfigError(f"SaveCost.wall_time must be finite, got {self.wall_time!r}")


class Schedule(Protocol):
    """Decides when the training loop saves.

    Call sequence: the Checkpointer calls :meth:`due` (any number of times, with non-decreasing ``now``)
    and, after every save it makes, :meth:`record` with that save's measured cost, as soon as ``save()``
    has returned: until then the policy still counts from the previous save and stays due. A save's drain
    finishes later, so ``SaveCost.drain_s`` may be that of the most recent save whose drain has finished.
    Implementations are not thread-safe: call them from the training loop's thread.
    """

    def due(self, step: int, now: float) -> bool:
        """Whether the loop should save at ``step``, the clock reading ``now``."""
        ...

    def record(self, cost: SaveCost) -> None:
        """Learn from a save that just happened."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class EveryNSteps:
    """Save when the step is a positive multiple of ``interval_steps``.

    Step 0 is never due: it is the initial state, which a restart can rebuild without a checkpoint.

    Attributes:
        interval_steps: steps between saves.
    """

    interval_steps: int

    def __post_init__(self) -> None:
        _require_count("interval_steps", self.interval_steps)

    def due(self, step: int, now: float) -> bool:
        """True when ``step`` is a positive multiple of :attr:`interval_steps`."""
        return step > 0 and step % self.interval_steps == 0

    def record(self, cost: SaveCost) -> None:
        """Nothing to learn: the cadence is fixed in steps."""


class EverySeconds:
    """Save when ``interval_s`` seconds have passed since the previous save started.

    Before the first save the clock starts at the first :meth:`due` call, i.e. when training starts.
    """

    __slots__ = ("_last_start", "interval_s")

    def __init__(self, interval_s: float) -> None:
        """Create the policy.

        Args:
            interval_s: seconds from one save's start to the next.

        Raises:
            ConfigError: ``interval_s <= 0``.
        """
        self.interval_s = _require_positive("interval_s", interval_s)
        self._last_start: float | None = None

    def __repr__(self) -> str:
        return f"EverySeconds(interval_s={self.interval_s:g})"

    def due(self, step: int, now: float) -> bool:
        """True once ``interval_s`` has passed since the last save started."""
        if self._last_start is None:
            self._last_start = now
        return now - self._last_start >= self.interval_s

    def record(self, cost: SaveCost) -> None:
        """Restart the clock at the save's start."""
        self._last_start = cost.wall_time

    def tier_every(self, drain_s: float) -> int:
        """The smallest cadence at which a tier whose drain takes ``drain_s`` keeps up."""
        return tier_every_for(drain_s, self.interval_s)


class AutoSchedule:
    """Save at the Young/Daly optimum for the measured checkpoint cost and the given MTTF.

    The cost ``C`` is the time ``save()`` blocked the loop, measured on every save and smoothed with an
    exponentially weighted moving average, so one slow save does not swing the interval. The interval is
    recomputed after every save and clamped to ``[min_interval_s, max_interval_s]``. Until the first
    measurement the interval uses ``initial_cost_s``, small on purpose: the first save then comes early,
    which both protects the work and measures the real cost.

    The interval counts compute time, from the end of a save's blocking part to the start of the next,
    which is what Young and Daly optimise. Not thread-safe: call from the training loop's thread.

    Example::

        >>> auto = AutoSchedule(mttf_s=3600.0, formula="young")
        >>> auto.record(SaveCost(step=10, blocked_s=2.0, drain_s=30.0, wall_time=100.0))
        >>> auto.interval_s, auto.due(11, now=221.0), auto.due(12, now=222.0)
        (120.0, False, True)
    """

    __slots__ = (
        "_cost_s",
        "_drain_s",
        "_interval_s",
        "_next_due",
        "formula",
        "initial_cost_s",
        "max_interval_s",
        "min_interval_s",
        "mttf_s",
        "restart_s",
        "saves",
        "smoothing",
    )

    def __init__(
        self,
        mttf_s: float,
        restart_s: float = 0.0,
        *,
        min_interval_s: float = 30.0,
        max_interval_s: float | None = None,
        initial_cost_s: float = 5.0,
        smoothing: float = 0.3,
        formula: Formula | str = Formula.DALY,
    ) -> None:
        """Create the policy.

        Args:
            mttf_s: the job's mean time between failures (cluster MTTF), in seconds.
            restart_s: time from a failure until training runs again; used for :attr:`expected_goodput`
                (the optimal interval does not depend on it).
            min_interval_s: never save more often than this: a tiny measured cost would otherwise ask for
                saves every few seconds, whose background drains compete with training for bandwidth.
            max_interval_s: never save less often than this; the MTTF when omitted.
            initial_cost_s: the cost assumed before the first save is measured.
            smoothing: weight of the newest measurement in the moving average (1 = no smoothing).
            formula: ``"daly"`` (default) or ``"young"``.

        Raises:
            ConfigError: ``mttf_s <= 0``, a negative time, ``min_interval_s > max_interval_s`` or
                ``smoothing`` outside ``(0, 1]``.
        """
        self.mttf_s = _require_positive("mttf_s", mttf_s)
        self.restart_s = _require_non_negative("restart_s", restart_s)
        self.min_interval_s = _require_non_negative("min_interval_s", min_interval_s)
        self.max_interval_s = (
            self.mttf_s if max_interval_s is None else _require_positive("max_interval_s", max_interval_s)
        )
        if self.min_interval_s > self.max_interval_s:
            raise ConfigError(f"min_interval_s={self.min_interval_s:g} exceeds max_interval_s={self.max_interval_s:g}")
        self.initial_cost_s = _require_non_negative("initial_cost_s", initial_cost_s)
        if isinstance(smoothing, bool) or not (isinstance(smoothing, (int, float)) and 0 < smoothing <= 1):
            raise ConfigError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = float(smoothing)
        self.formula = _formula(formula)
        self.saves = 0
        self._cost_s: float | None = None
        self._drain_s: float | None = None
        self._next_due: float | None = None
        self._interval_s = self._compute_interval(self.initial_cost_s)

    def __repr__(self) -> str:
        return (
            f"AutoSchedule(mttf_s={self.mttf_s:g}, restart_s={self.restart_s:g}, "
            f"formula={self.formula.value!r}, interval_s={self._interval_s:.4g}, "
            f"cost_s={self.cost_s:.4g}, saves={self.saves})"
        )

    def _compute_interval(self, cost_s: float) -> float:
        best = optimal_interval_s(cost_s, self.mttf_s, self.formula)
        return min(max(best, self.min_interval_s), self.max_interval_s)

    @property
    def cost_s(self) -> float:
        """The smoothed measured blocked time, or ``initial_cost_s`` before the first save."""
        return self.initial_cost_s if self._cost_s is None else self._cost_s

    @property
    def drain_s(self) -> float | None:
        """The smoothed measured drain time to the slowest tier, ``None`` before the first save."""
        return self._drain_s

    @property
    def interval_s(self) -> float:
        """The current compute interval between saves."""
        return self._interval_s

    @property
    def period_s(self) -> float:
        """The expected time from save start to save start: interval plus cost."""
        return self._interval_s + self.cost_s

    @property
    def expected_goodput(self) -> float:
        """Expected useful fraction of wall time at the current interval and cost."""
        return expected_goodput(self._interval_s, self.cost_s, self.mttf_s, self.restart_s)

    def due(self, step: int, now: float) -> bool:
        """True once :attr:`interval_s` of compute has passed since the last save stopped blocking.

        The first call starts the clock when no save has been recorded yet.
        """
        if self._next_due is None:
            self._next_due = now + self._interval_s
        return now >= self._next_due

    def record(self, cost: SaveCost) -> None:
        """Fold the save's blocked and drain times into the averages and recompute the interval."""
        self.saves += 1
        self._cost_s = self._smooth(self._cost_s, cost.blocked_s)
        self._drain_s = self._smooth(self._drain_s, cost.drain_s)
        self._interval_s = self._compute_interval(self._cost_s)
        self._next_due = cost.wall_time + cost.blocked_s + self._interval_s

    def _smooth(self, average: float | None, sample: float) -> float:
        if average is None:
            return sample
        return self.smoothing * sample + (1.0 - self.smoothing) * average

    def tier_every(self, drain_s: float) -> int:
        """The smallest ``N`` such that a tier whose drain takes ``drain_s`` keeps up with every N-th save.

        Uses the current period (interval plus cost). The Checkpointer widens a slow tier's cadence to at
        least this and warns.

        Raises:
            ConfigError: ``drain_s < 0``.
        """
        return tier_every_for(drain_s, self.period_s)


_AUTO_KEYS = {
    "mttf": "mttf_s",
    "restart": "restart_s",
    "min": "min_interval_s",
    "max": "max_interval_s",
    "initial_cost": "initial_cost_s",
}
_SCHEDULE_FORMS = (
    "'steps:N', 'seconds:T' (T like 600, 10min, 1h) or "
    "'auto:mttf=4h[,restart=10min,min=30s,max=2h,initial_cost=5s,smoothing=0.3,formula=daly]'"
)


def parse_schedule(spec: str | int | float | Schedule | None) -> Schedule | None:
    """Turn the ``schedule=`` argument of the Checkpointer into a :class:`Schedule`.

    Args:
        spec: ``None`` (no schedule: the loop decides), a :class:`Schedule`, an ``int`` (every N steps),
            a ``float`` (every T seconds), or a string: ``"steps:100"``, ``"seconds:600"``,
            ``"seconds:10min"``, ``"auto:mttf=4h"``, ``"auto:mttf=4h,restart=10min,min=30s,formula=young"``.

    Raises:
        ConfigError: anything else, with the accepted forms in the message.
    """
    if spec is None:
        return None
    if isinstance(spec, bool):
        raise ConfigError(f"schedule must be one of {_SCHEDULE_FORMS}, got {spec!r}")
    if isinstance(spec, int):
        return EveryNSteps(interval_steps=spec)
    if isinstance(spec, float):
        return EverySeconds(spec)
    if not isinstance(spec, str):
        if callable(getattr(spec, "due", None)) and callable(getattr(spec, "record", None)):
            return spec
        raise ConfigError(f"schedule must be a Schedule or one of {_SCHEDULE_FORMS}, got {spec!r}")
    kind, sep, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if not sep or not rest.strip():
        raise ConfigError(f"schedule {spec!r} must be one of {_SCHEDULE_FORMS}")
    if kind == "steps":
        try:
            steps = int(rest.strip())
        except ValueError:
            raise ConfigError(f"schedule {spec!r}: the step count must be an integer") from None
        return EveryNSteps(interval_steps=steps)
    if kind == "seconds":
        return EverySeconds(parse_duration(rest))
    if kind == "auto":
        return _parse_auto(spec, rest)
    raise ConfigError(f"unknown schedule kind {kind!r} in {spec!r}; use {_SCHEDULE_FORMS}")


def _parse_auto(spec: str, options: str) -> AutoSchedule:
    times: dict[str, float] = {}
    smoothing = 0.3
    formula: str = Formula.DALY.value
    for item in options.split(","):
        key, eq, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or not value:
            raise ConfigError(f"schedule {spec!r}: expected KEY=VALUE, got {item.strip()!r}")
        if key in _AUTO_KEYS:
            times[_AUTO_KEYS[key]] = parse_duration(value)
        elif key == "smoothing":
            try:
                smoothing = float(value)
            except ValueError:
                raise ConfigError(f"schedule {spec!r}: smoothing must be a number, got {value!r}") from None
        elif key == "formula":
            formula = value
        else:
            known = ", ".join([*_AUTO_KEYS, "smoothing", "formula"])
            raise ConfigError(f"schedule {spec!r}: unknown option {key!r}; known options: {known}")
    if "mttf_s" not in times:
        raise ConfigError(f"schedule {spec!r}: auto needs the cluster MTTF, e.g. 'auto:mttf=4h'")
    return AutoSchedule(
        times["mttf_s"],
        times.get("restart_s", 0.0),
        min_interval_s=times.get("min_interval_s", 30.0),
        max_interval_s=times.get("max_interval_s"),
        initial_cost_s=times.get("initial_cost_s", 5.0),
        smoothing=smoothing,
        formula=formula,
    )
