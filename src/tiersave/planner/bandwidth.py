"""What the storage must sustain: bytes per day and write bandwidth per tier, and the cadence that keeps up.

Scope: for a checkpoint of a given size started every period, the checkpoints and bytes per day and the
sustained write bandwidth each tier needs, overall and per accelerator, and whether a tier of a given
bandwidth keeps up (:func:`plan_bandwidth`); the smallest cadence ``every=N`` at which a tier whose drain
takes a given time keeps up (:func:`tier_every_for`, which the schedules also use).

Anti-scope: choosing the period (:mod:`tiersave.planner.interval`), the checkpoint size
(:mod:`tiersave.planner.sizing`), measuring a real tier's bandwidth; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..units import SECONDS_PER_DAY
from ._checks import require_count, require_non_negative, require_positive

__all__ = ["BandwidthPlan", "TierLoad", "TierSpec", "plan_bandwidth", "tier_every_for"]


# Two float computations of "the same" period differ in the last bits; a tier whose drain equals its
# period exactly keeps up.
_REL_TOL = 1e-9


def tier_every_for(drain_s: float, period_s: float) -> int:
    """The smallest ``N`` such that a tier whose drain takes ``drain_s`` keeps up with every N-th checkpoint.

    A tier that receives every N-th checkpoint has ``N * period_s`` to make each one durable before the
    next arrives, so ``N = ceil(drain_s / period_s)``, at least 1.

    Raises:
        ConfigError: ``drain_s < 0`` or ``period_s <= 0``.
    """
    drain = require_non_negative("drain time", drain_s)
    period = require_positive("checkpoint period", period_s)
    return max(1, math.ceil(drain / period * (1.0 - _REL_TOL)))


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
        require_count(f"tier {self.name!r}: every", self.every)
        if self.bandwidth_bytes_per_s is not None:
            require_positive(f"tier {self.name!r}: bandwidth", self.bandwidth_bytes_per_s)


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
    require_count("checkpoint bytes", checkpoint_bytes)
    period = require_positive("checkpoint period", period_s)
    require_count("accelerators", accelerators)
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
