"""How often the job fails: components, observed records and the cluster MTTF.

Scope: the mean time between job interruptions (cluster MTTF) from component counts and per-component
MTTF (independent exponential failures, so rates add), from a given cluster or per-accelerator MTTF, or
from an observed record (N interruptions over D days on G accelerators); kept per accelerator so that
one model scales to another cluster size (:class:`FailureModel`).

Anti-scope: what to do about the failures (the interval and goodput are in
:mod:`tiersave.planner.interval`), correlated failures, anything that reads a clock or a log.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from ..units import SECONDS_PER_DAY, format_duration
from ._checks import require_count, require_positive

__all__ = ["Component", "FailureModel", "cluster_mttf_s"]


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
        require_count(f"component {self.name!r}: count", self.count)
        require_positive(f"component {self.name!r}: MTTF", self.mttf_s)


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
        require_count("accelerators", self.accelerators)
        require_positive("MTTF per accelerator", self.accelerator_mttf_s)

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
        mttf = require_positive("cluster MTTF", mttf_s)
        require_count("accelerators", accelerators)
        return cls(
            accelerators=accelerators,
            accelerator_mttf_s=mttf * accelerators,
            source=f"cluster MTTF {format_duration(mttf)} on {accelerators:,} accelerators (given)",
        )

    @classmethod
    def from_accelerator_mttf(cls, mttf_s: float, accelerators: int) -> FailureModel:
        """Each accelerator (with its share of the rest) fails every ``mttf_s`` seconds on average."""
        mttf = require_positive("MTTF per accelerator", mttf_s)
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
        require_count("interruptions", interruptions)
        span = require_positive("observed days", days)
        require_count("observed accelerators", accelerators)
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
        require_count("accelerators", accelerators)
        parts = ", ".join(f"{c.count:,} {c.name} x MTTF {format_duration(c.mttf_s)}" for c in components)
        return cls(
            accelerators=accelerators,
            accelerator_mttf_s=mttf * accelerators,
            source=f"components {parts} (independent exponential failures)",
        )
