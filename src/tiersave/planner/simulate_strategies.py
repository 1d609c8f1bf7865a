"""The strategies the goodput simulator compares, built from one description of a job.

Scope: the job as the simulator needs it (:class:`JobSpec`: cluster MTTF, checkpoint size, save costs,
rescheduling time, storage tiers) and the four strategies built from it (:func:`build_strategies`):

* ``fixed``: synchronous saves to durable storage every fixed period (``--period``; 20 per MTTF by
  default, the usual rule of thumb);
* ``young``: the same at the Young/Daly optimum for the synchronous save's cost;
* ``async``: one durable tier, asynchronous: the save blocks only for the staging copy, the write runs in
  the background, and saves come no more often than that write allows;
* ``tiered``: memory every few minutes (Daly's optimum for the staging cost, clamped like
  :class:`~tiersave.planner.schedule.AutoSchedule`), a replica in a peer node's memory, durable storage
  every N-th save with N the smallest cadence that keeps up (``tier_every_for``); ``tiered-nopeer`` is the
  same without the replica.

Tiers are told apart by name (:func:`tier_kind`): memory, node-local disk, peer replica, durable. A read
is assumed as fast as a write on the same tier.

Anti-scope: the simulation itself (:mod:`tiersave.planner.simulate`), parsing a command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from ..errors import ConfigError
from ..units import format_duration
from ._checks import require_count, require_non_negative, require_positive
from .bandwidth import TierSpec, tier_every_for
from .interval import Formula, optimal_interval_s
from .simulate import SimTier, Strategy

__all__ = ["ALL_STRATEGIES", "DEFAULT_STRATEGIES", "JobSpec", "TierKind", "build_strategies", "tier_kind"]

DEFAULT_STRATEGIES = ("fixed", "young", "async", "tiered")
ALL_STRATEGIES = (*DEFAULT_STRATEGIES, "tiered-nopeer")

# Per-accelerator bandwidths assumed for the tiers a job does not describe: a device-to-host copy over
# PCIe (memory tier, and its read back), and a share of a node's network to a peer's memory.
MEMORY_BW_PER_ACCELERATOR = 10e9
PEER_BW_PER_ACCELERATOR = 5e9


class TierKind(str, Enum):
    """What a failure does to a tier: memory and local disk live on the nodes; a peer replica survives the
    loss of one node; durable storage survives everything."""

    MEMORY = "memory"
    LOCAL = "local"
    PEER = "peer"
    DURABLE = "durable"


_KIND_NAMES = {
    TierKind.MEMORY: ("memory", "mem", "shm", "ram", "host"),
    TierKind.LOCAL: ("local", "disk", "nvme", "ssd"),
    TierKind.PEER: ("peer", "replica", "buddy"),
}


def tier_kind(name: str) -> TierKind:
    """The kind of a tier from its name: ``memory``/``mem``/``shm``/``ram``/``host``,
    ``local``/``disk``/``nvme``/``ssd``, ``peer``/``replica``/``buddy``; anything else is durable."""
    lowered = name.strip().lower()
    for kind, names in _KIND_NAMES.items():
        if any(lowered == n or lowered.startswith(n + "-") or lowered.startswith(n + "_") for n in names):
            return kind
    return TierKind.DURABLE


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """A training job as the simulator sees it.

    Attributes:
        mttf_s: the cluster MTTF.
        accelerators: accelerators in the job (for per-accelerator bandwidths and accelerator-hours).
        checkpoint_bytes: bytes of one checkpoint of the whole job, when known.
        sync_cost_s: time a synchronous save to durable storage blocks training (``C`` of ``fixed`` and
            ``young``); the size over the durable tier's bandwidth when omitted.
        stage_cost_s: time an asynchronous save blocks training (the staging copy); the size over the
            memory bandwidth when omitted.
        reschedule_s: time from a failure until the job starts reading its checkpoint back (detection,
            rescheduling, start-up); the read itself is added per tier.
        fixed_period_s: the period of ``fixed``; the MTTF / 20 when omitted.
        formula: Daly's or Young's optimum for ``young`` (and the others' intervals).
        tiers: the storage tiers described (name, cadence, bandwidth).
        min_interval_s: the shortest interval an optimum is clamped to, as ``AutoSchedule`` does.
    """

    mttf_s: float
    accelerators: int
    checkpoint_bytes: int | None = None
    sync_cost_s: float | None = None
    stage_cost_s: float | None = None
    reschedule_s: float = 0.0
    fixed_period_s: float | None = None
    formula: Formula = Formula.DALY
    tiers: tuple[TierSpec, ...] = ()
    min_interval_s: float = 30.0

    def __post_init__(self) -> None:
        require_positive("cluster MTTF", self.mttf_s)
        require_count("accelerators", self.accelerators)
        if self.checkpoint_bytes is not None:
            require_count("checkpoint bytes", self.checkpoint_bytes)
        for what, value in (("checkpoint cost", self.sync_cost_s), ("stage cost", self.stage_cost_s)):
            if value is not None:
                require_non_negative(what, value)
        require_non_negative("restart (rescheduling) time", self.reschedule_s)
        if self.fixed_period_s is not None:
            require_positive("checkpoint period", self.fixed_period_s)
        require_positive("minimum interval", self.min_interval_s)

    def scaled_to(self, accelerators: int) -> JobSpec:
        """The same job on ``accelerators`` accelerators: the failure rate per accelerator is kept, and the
        default memory and peer bandwidths grow with the accelerators; sizes, costs and given tiers stay."""
        require_count("accelerators", accelerators)
        return dataclasses.replace(
            self, mttf_s=self.mttf_s * self.accelerators / accelerators, accelerators=accelerators
        )

    def _tier(self, kind: TierKind) -> TierSpec | None:
        found = [t for t in self.tiers if tier_kind(t.name) is kind]
        if not found:
            return None
        # the slowest tier of a kind is the one that decides its cost
        return min(found, key=lambda t: t.bandwidth_bytes_per_s or float("inf"))

    def _seconds(self, bandwidth: float | None) -> float | None:
        if self.checkpoint_bytes is None or bandwidth is None:
            return None
        return self.checkpoint_bytes / bandwidth


def build_strategies(job: JobSpec, names: Sequence[str] | None = None) -> tuple[list[Strategy], list[str]]:
    """The strategies called ``names`` (the four defaults when omitted), and the assumptions they rest on.

    Raises:
        ConfigError: an unknown name, or a strategy whose inputs are missing (a synchronous cost for
            ``fixed``/``young``; a checkpoint size and a durable tier's bandwidth for ``async``/``tiered``),
            or a fixed period shorter than the save.
    """
    wanted = list(names) if names else list(DEFAULT_STRATEGIES)
    for name in wanted:
        if name not in ALL_STRATEGIES:
            raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(ALL_STRATEGIES)}")
    notes: list[str] = []
    durable = job._tier(TierKind.DURABLE)
    durable_s = job._seconds(durable.bandwidth_bytes_per_s if durable else None)
    sync_cost = job.sync_cost_s if job.sync_cost_s is not None else durable_s
    memory = job._tier(TierKind.MEMORY)
    memory_bw = memory.bandwidth_bytes_per_s if memory and memory.bandwidth_bytes_per_s else None
    if memory_bw is None:
        memory_bw = MEMORY_BW_PER_ACCELERATOR * job.accelerators
    peer = job._tier(TierKind.PEER)
    peer_bw = peer.bandwidth_bytes_per_s if peer and peer.bandwidth_bytes_per_s else None
    if peer_bw is None:
        peer_bw = PEER_BW_PER_ACCELERATOR * job.accelerators
    stage = job.stage_cost_s if job.stage_cost_s is not None else job._seconds(memory_bw)
    size = job.checkpoint_bytes or 0
    durable_name = durable.name if durable else "durable"
    durable_read = durable_s if durable_s is not None else 0.0
    if durable_s is None and any(n in ("fixed", "young") for n in wanted):
        notes.append("durable reads not timed (no checkpoint size or durable bandwidth): a restart takes --restart")

    def sync_tier() -> SimTier:
        return SimTier(name=durable_name, restore_s=durable_read, bytes_per_write=size)

    def need_sync(name: str) -> float:
        if sync_cost is None:
            raise ConfigError(
                f"strategy {name!r} needs the time a synchronous save blocks training: give --checkpoint-cost, "
                "or a checkpoint size and a durable tier's bandwidth (--tier durable,bw=BW or --storage-bw)"
            )
        return sync_cost

    def need_async(name: str) -> tuple[float, float]:
        if durable_s is None or stage is None:
            raise ConfigError(
                f"strategy {name!r} needs the checkpoint size (--model, --params or --size) and the durable "
                "tier's bandwidth (--tier durable,bw=BW or --storage-bw) to time its background writes"
            )
        return stage, durable_s

    def optimum(cost: float) -> float:
        return max(optimal_interval_s(cost, job.mttf_s, job.formula), job.min_interval_s)

    out: list[Strategy] = []
    for name in wanted:
        if name == "fixed":
            cost = need_sync(name)
            period = job.fixed_period_s if job.fixed_period_s is not None else job.mttf_s / 20.0
            if cost >= period:
                raise ConfigError(
                    f"strategy 'fixed': a save blocking {format_duration(cost)} does not fit in its period of "
                    f"{format_duration(period)}"
                )
            chosen = "--period" if job.fixed_period_s is not None else "MTTF / 20 (default; give --period)"
            out.append(
                Strategy(
                    name=name,
                    interval_s=period - cost,
                    blocked_s=cost,
                    tiers=(sync_tier(),),
                    reschedule_s=job.reschedule_s,
                    description=f"synchronous saves to {durable_name} every {format_duration(period)} ({chosen}), "
                    f"blocking {format_duration(cost)}",
                )
            )
        elif name == "young":
            cost = need_sync(name)
            interval = optimum(cost)
            out.append(
                Strategy(
                    name=name,
                    interval_s=interval,
                    blocked_s=cost,
                    tiers=(sync_tier(),),
                    reschedule_s=job.reschedule_s,
                    description=f"synchronous saves to {durable_name} at the {job.formula.value} optimum, "
                    f"{format_duration(interval)} of compute apart, blocking {format_duration(cost)}",
                )
            )
        elif name == "async":
            stage_s, write_s = need_async(name)
            interval = max(optimum(stage_s), write_s)
            out.append(
                Strategy(
                    name=name,
                    interval_s=interval,
                    blocked_s=stage_s,
                    tiers=(SimTier(name=durable_name, write_s=write_s, restore_s=write_s, bytes_per_write=size),),
                    reschedule_s=job.reschedule_s,
                    description=f"asynchronous saves to {durable_name} every {format_duration(interval)} of "
                    f"compute, blocking {format_duration(stage_s)}, written in {format_duration(write_s)}",
                )
            )
        else:
            out.append(_tiered(job, name, need_async(name), memory_bw, peer_bw, optimum))
    if stage is not None and any(n in ("async", "tiered", "tiered-nopeer") for n in wanted):
        how = "given" if job.stage_cost_s is not None else "checkpoint size / memory bandwidth"
        notes.append(f"an asynchronous save blocks training {format_duration(stage)} ({how})")
    return out, notes


def _tiered(
    job: JobSpec,
    name: str,
    costs: tuple[float, float],
    memory_bw: float,
    peer_bw: float,
    optimum: Callable[[float], float],
) -> Strategy:
    stage_s, durable_s = costs
    size = job.checkpoint_bytes or 0
    interval = optimum(stage_s)
    period = interval + stage_s
    memory = job._tier(TierKind.MEMORY)
    tiers = [
        SimTier(
            name=memory.name if memory else "memory",
            restore_s=size / memory_bw,
            survives_node_loss=False,
            bytes_per_write=size,
        )
    ]
    for local in (t for t in job.tiers if tier_kind(t.name) is TierKind.LOCAL):
        write = size / local.bandwidth_bytes_per_s if local.bandwidth_bytes_per_s else 0.0
        every = max(local.every, tier_every_for(write, period))
        tiers.append(
            SimTier(
                name=local.name,
                write_s=write,
                restore_s=write,
                every=every,
                survives_node_loss=False,
                bytes_per_write=size,
            )
        )
    if name == "tiered":
        peer = job._tier(TierKind.PEER)
        write = size / peer_bw
        tiers.append(
            SimTier(
                name=peer.name if peer else "peer",
                write_s=write,
                restore_s=write,
                every=max(peer.every if peer else 1, tier_every_for(write, period)),
                bytes_per_write=size,
            )
        )
    durable = job._tier(TierKind.DURABLE)
    every = max(durable.every if durable else 1, tier_every_for(durable_s, period))
    tiers.append(
        SimTier(
            name=durable.name if durable else "durable",
            write_s=durable_s,
            restore_s=durable_s,
            every=every,
            bytes_per_write=size,
        )
    )
    replica = "a peer replica, " if name == "tiered" else "no peer replica, "
    return Strategy(
        name=name,
        interval_s=interval,
        blocked_s=stage_s,
        tiers=tuple(tiers),
        reschedule_s=job.reschedule_s,
        description=f"memory every {format_duration(period)} ({job.formula.value} optimum for the staging cost), "
        f"{replica}{tiers[-1].name} {'every save' if every == 1 else f'every {every} saves'}",
    )
