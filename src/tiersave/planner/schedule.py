"""When the training loop saves: the policies a Checkpointer asks, and the ``schedule=`` argument parser.

Scope: the :class:`Schedule` protocol (``due(step, now)`` and ``record(SaveCost)``), the measured
:class:`SaveCost` of one save, the policies :class:`EveryNSteps`, :class:`EverySeconds` and
:class:`AutoSchedule` (which applies Young/Daly to the blocked time it measures and tells how far a slow
tier's cadence must widen, ``tier_every``), and :func:`parse_schedule`, which turns ``"steps:100"``,
``"seconds:10min"`` or ``"auto:mttf=4h"`` into one of them.

Anti-scope: the formulas themselves (:mod:`tiersave.planner.interval`,
:mod:`tiersave.planner.bandwidth`); no clocks of its own (callers pass ``now``), no threads, no I/O,
no torch; acting on the answer (saving, widening a tier) is the Checkpointer's job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from ..errors import ConfigError
from ..units import parse_duration
from ._checks import require_count, require_non_negative, require_positive
from .bandwidth import tier_every_for
from .interval import Formula, expected_goodput, optimal_interval_s

__all__ = ["AutoSchedule", "EveryNSteps", "EverySeconds", "SaveCost", "Schedule", "parse_schedule"]


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
        require_non_negative("SaveCost.blocked_s", self.blocked_s)
        require_non_negative("SaveCost.drain_s", self.drain_s)
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
        require_count("interval_steps", self.interval_steps)

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
        self.interval_s = require_positive("interval_s", interval_s)
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
        self.mttf_s = require_positive("mttf_s", mttf_s)
        self.restart_s = require_non_negative("restart_s", restart_s)
        self.min_interval_s = require_non_negative("min_interval_s", min_interval_s)
        self.max_interval_s = (
            self.mttf_s if max_interval_s is None else require_positive("max_interval_s", max_interval_s)
        )
        if self.min_interval_s > self.max_interval_s:
            raise ConfigError(f"min_interval_s={self.min_interval_s:g} exceeds max_interval_s={self.max_interval_s:g}")
        self.initial_cost_s = require_non_negative("initial_cost_s", initial_cost_s)
        if isinstance(smoothing, bool) or not (isinstance(smoothing, (int, float)) and 0 < smoothing <= 1):
            raise ConfigError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.smoothing = float(smoothing)
        self.formula = Formula.parse(formula)
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
