"""The ``tiersave plan`` command line, parsed and validated into planner objects.

Scope: the mode, the checkpoint size (preset, parameter count or bytes) with its layout, the failure model
(cluster or per-accelerator MTTF, an observed record, components), the interval options and the tiers
(``NAME[,every=N][,bw=BW]``), with the assumption behind every default (:class:`PlanInputs`).

Anti-scope: defining the options (:mod:`tiersave.cli.plan_cmd`), rendering results
(:mod:`tiersave.cli.plan_report`), the planner arithmetic (:mod:`tiersave.planner`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from enum import Enum

from ..errors import ConfigError
from ..planner.architecture import get_preset
from ..planner.bandwidth import TierSpec
from ..planner.failures import Component, FailureModel
from ..planner.interval import Formula, IntervalPlan, plan_interval
from ..planner.sizing import CheckpointSize, Parallelism, checkpoint_size
from ..units import format_duration, format_si_bytes, human_bytes, parse_bytes, parse_count, parse_duration

__all__ = ["PlanInputs", "PlanMode", "si_and_binary_bytes"]


class PlanMode(str, Enum):
    """What ``tiersave plan`` reports."""

    SWEEP = "sweep"
    PRESETS = "presets"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanInputs:
    """The command line, parsed and validated into planner objects."""

    size: CheckpointSize | None
    checkpoint_bytes: int | None
    accelerators: int
    failure: FailureModel | None
    cost_s: float | None
    restart_s: float
    formula: Formula
    period_s: float | None
    checkpoints_per_mttf: float | None
    tiers: tuple[TierSpec, ...]
    assumptions: tuple[str, ...]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlanInputs:
        notes: list[str] = []
        failure, observed_on = _failure(args)
        accelerators = _default_accelerators(args, observed_on)
        if args.accelerators is None and args.mode is not PlanMode.SWEEP:
            notes.append(f"{_plural(accelerators, 'accelerator')} (default; give --accelerators)")
        if failure is not None:
            failure = failure.scaled_to(accelerators)
        size: CheckpointSize | None = None
        checkpoint_bytes: int | None = None
        if args.size is not None:
            checkpoint_bytes = parse_bytes(args.size)
            notes.append(f"checkpoint size {si_and_binary_bytes(checkpoint_bytes)} (given)")
        elif args.model is not None or args.params is not None:
            model = get_preset(args.model) if args.model is not None else parse_count(args.params)
            layout = Parallelism.for_world(accelerators, tp=args.tp, pp=args.pp, zero_stage=args.zero)
            size = checkpoint_size(model, args.recipe, layout)
            checkpoint_bytes = size.total_bytes
            notes.extend(size.assumptions)
        tiers = tuple(_parse_tier(spec) for spec in args.tier or ())
        if args.storage_bw is not None:
            tiers += (TierSpec(name="storage", bandwidth_bytes_per_s=parse_bytes(args.storage_bw)),)
        cost_s = None if args.checkpoint_cost is None else parse_duration(args.checkpoint_cost)
        needs_cost = args.period is None and args.checkpoints_per_mttf is None
        if cost_s is None and needs_cost and checkpoint_bytes is not None:
            slowest = min((t for t in tiers if t.bandwidth_bytes_per_s), default=None, key=_bandwidth)
            if slowest is not None:
                cost_s = checkpoint_bytes / _bandwidth(slowest)
                notes.append(
                    f"checkpoint cost C = size / {slowest.name} bandwidth = {format_duration(cost_s)}, "
                    "a synchronous save; with asynchronous saves C is only the staging copy: "
                    "give --checkpoint-cost"
                )
        if failure is not None:
            notes.append(f"failures: {failure.source}; independent and exponentially distributed")
        if failure is not None and cost_s is not None:
            notes.append(
                "goodput from Daly's complete model: a failure costs the restart time plus the work since "
                "the last checkpoint, and may also strike during saves and restarts"
            )
        return cls(
            size=size,
            checkpoint_bytes=checkpoint_bytes,
            accelerators=accelerators,
            failure=failure,
            cost_s=cost_s,
            restart_s=parse_duration(args.restart),
            formula=args.formula,
            period_s=None if args.period is None else parse_duration(args.period),
            checkpoints_per_mttf=args.checkpoints_per_mttf,
            tiers=tiers,
            assumptions=tuple(notes),
        )

    def interval(self, failure: FailureModel) -> IntervalPlan:
        return plan_interval(
            failure,
            cost_s=self.cost_s,
            restart_s=self.restart_s,
            formula=self.formula,
            period_s=self.period_s,
            checkpoints_per_mttf=self.checkpoints_per_mttf,
        )


def _bandwidth(tier: TierSpec) -> float:
    return tier.bandwidth_bytes_per_s or math.inf


def _default_accelerators(args: argparse.Namespace, observed_on: int | None) -> int:
    """--accelerators, else the observed cluster, else one data-parallel replica of tp x pp."""
    if args.accelerators is not None:
        if args.accelerators < 1:
            raise ConfigError(f"--accelerators must be at least 1, got {args.accelerators}")
        return int(args.accelerators)
    return observed_on if observed_on is not None else int(args.tp * args.pp)


def _failure(args: argparse.Namespace) -> tuple[FailureModel | None, int | None]:
    """The failure model from whichever rate option was given, and the observed cluster size if any."""
    accelerators = _default_accelerators(args, None)
    if args.cluster_mttf is not None:
        return FailureModel.from_cluster_mttf(parse_duration(args.cluster_mttf), accelerators), None
    if args.accelerator_mttf is not None:
        return FailureModel.from_accelerator_mttf(parse_duration(args.accelerator_mttf), accelerators), None
    if args.observed is not None:
        fields = args.observed.split(",")
        if len(fields) != 3:
            raise ConfigError(f"--observed {args.observed!r}: expected N,DAYS,G such as 419,54,16384")
        try:
            interruptions, days, observed_on = int(fields[0]), float(fields[1]), int(fields[2])
        except ValueError:
            raise ConfigError(f"--observed {args.observed!r}: N and G must be integers, DAYS a number") from None
        record = FailureModel.from_record(interruptions=interruptions, days=days, accelerators=observed_on)
        return record, observed_on
    if args.component:
        return FailureModel.from_components([_parse_component(c) for c in args.component], accelerators), None
    return None, None


def _parse_component(spec: str) -> Component:
    name, eq, rest = spec.partition("=")
    count, at, mttf = rest.partition("@")
    if not (eq and at and name.strip()):
        raise ConfigError(f"--component {spec!r}: expected NAME=COUNT@MTTF such as gpu=16384@50000h")
    try:
        number = int(count)
    except ValueError:
        raise ConfigError(f"--component {spec!r}: COUNT must be an integer") from None
    return Component(name=name.strip(), count=number, mttf_s=parse_duration(mttf))


def _parse_tier(spec: str) -> TierSpec:
    name, *options = (part.strip() for part in spec.split(","))
    every, bandwidth = 1, None
    for option in options:
        key, _, value = option.partition("=")
        if key == "every":
            try:
                every = int(value)
            except ValueError:
                raise ConfigError(f"--tier {spec!r}: every must be an integer") from None
        elif key == "bw":
            bandwidth = float(parse_bytes(value))
        else:
            raise ConfigError(f"--tier {spec!r}: unknown option {option!r}; expected every=N or bw=BANDWIDTH")
    if not name:
        raise ConfigError(f"--tier {spec!r}: the tier needs a name, e.g. durable,every=4,bw=10GB/s")
    return TierSpec(name=name, every=every, bandwidth_bytes_per_s=bandwidth)


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def si_and_binary_bytes(n: float) -> str:
    """``"4.87 TB (4.43 TiB)"``: decimal as storage is sold, binary as memory is counted."""
    return f"{format_si_bytes(n)} ({human_bytes(n)})"
