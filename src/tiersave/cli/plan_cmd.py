"""``tiersave plan``: checkpoint size, cluster MTTF, optimal interval and bandwidth, as a table or JSON.

Imports only the standard library and the torch-free planner modules, so it starts fast anywhere;
matplotlib is imported only when ``sweep --plot`` asks for a figure.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import BackendUnavailableError, ConfigError
from ..planner.architecture import PRESETS, get_preset
from ..planner.bandwidth import BandwidthPlan, TierSpec, plan_bandwidth
from ..planner.failures import Component, FailureModel
from ..planner.interval import Formula, IntervalPlan, plan_interval
from ..planner.recipes import RECIPES
from ..planner.sizing import CheckpointSize, Parallelism, checkpoint_size
from ..units import SECONDS_PER_DAY, format_duration, format_si_bytes, parse_bytes, parse_count, parse_duration
from ._common import EXIT_OK, Output, add_json_flag, human_bytes, table

_DEFAULT_RECIPE = "bf16-adam-mixed"

_EPILOG = """\
modes:
  (none)    size, failure model, interval and bandwidth for one job; each section appears when its
            inputs are given (a model for the size, a failure rate for the interval, both for bandwidth)
  sweep     the same failure model over a range of cluster sizes; --plot FILE writes a PNG
  presets   list the model presets and precision recipes

units: durations like 90s, 6.2min, 4h, 1h30m, 2d, 5y; sizes and bandwidths in decimal (5TB, 13GB/s)
or binary (130GiB) units; parameter counts like 124M, 8B, 70.6e9.

examples:
  # Llama 3 70B weights only in bf16 (about 130 GiB)
  tiersave plan --model llama3-70b --recipe bf16-weights-only
  # 24,000 accelerators interrupted every 124 minutes, 20 checkpoints between failures, 405B state
  tiersave plan --model llama3-405b --recipe bf16-adam-master --accelerators 24000 \\
      --cluster-mttf 124min --checkpoints-per-mttf 20
  # Daly's optimum for a 30 s save, scaled from the Llama 3 405B run's record, with two tiers
  tiersave plan --model llama3-405b --accelerators 16384 --tp 8 --pp 16 --zero 1 \\
      --observed 419,54,16384 --checkpoint-cost 30s --restart 10min \\
      --tier local,bw=2TB/s --tier durable,every=4,bw=10GB/s
  # MTTF and optimal interval from 8 to 131,072 accelerators, as a table and a PNG
  tiersave plan sweep --accelerator-mttf 50000h --checkpoint-cost 30s --plot sweep.png
"""


class PlanMode(str, Enum):
    """What ``tiersave plan`` reports."""

    SWEEP = "sweep"
    PRESETS = "presets"

    def __str__(self) -> str:
        return self.value


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand to the ``tiersave`` parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="checkpoint size, cluster MTTF, optimal interval and bandwidth needed",
        description=(  # RawDescriptionHelpFormatter keeps the epilog's layout, so wrap by hand
            "Plan checkpointing for a training job: the size of a checkpoint from a model and a\n"
            "precision recipe, the cluster MTTF, Young's and Daly's optimal interval, the expected\n"
            "goodput, and the write bandwidth each storage tier needs. Every figure states its\n"
            "assumptions. Worked examples and the formulas: docs/planning.md."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mode", nargs="?", type=PlanMode, metavar="{sweep,presets}", help="optional mode (see below)")
    model = parser.add_argument_group("checkpoint size (give one of --model, --params, --size)")
    size_source = model.add_mutually_exclusive_group()
    size_source.add_argument("--model", metavar="PRESET", help="architecture preset, e.g. llama3-70b")
    size_source.add_argument("--params", metavar="COUNT", help="parameter count, e.g. 70.6B")
    size_source.add_argument("--size", metavar="BYTES", help="checkpoint size of the whole job, e.g. 4.9TB")
    model.add_argument(
        "--recipe",
        default=_DEFAULT_RECIPE,
        metavar="RECIPE",
        help=f"bytes per parameter of each saved component: a preset or a spec such as "
        f"'weights=bf16,master=fp32,moments=fp32+fp32' (default {_DEFAULT_RECIPE})",
    )
    layout = parser.add_argument_group("layout")
    layout.add_argument("--accelerators", type=int, metavar="N", help="accelerators (ranks) in the job")
    layout.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel degree (default 1)")
    layout.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline-parallel degree (default 1)")
    zero = layout.add_mutually_exclusive_group()
    zero.add_argument(
        "--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage of the data-parallel sharding"
    )
    zero.add_argument("--fsdp", action="store_const", const=3, dest="zero", help="FSDP, same as --zero 3")
    failures = parser.add_argument_group("failure rate (give one)")
    rate = failures.add_mutually_exclusive_group()
    rate.add_argument("--cluster-mttf", metavar="DURATION", help="mean time between job interruptions")
    rate.add_argument("--accelerator-mttf", metavar="DURATION", help="MTTF of one accelerator and its share")
    rate.add_argument(
        "--observed",
        metavar="N,DAYS,G",
        help="N interruptions seen over DAYS days on G accelerators, e.g. 419,54,16384 (Llama 3 405B)",
    )
    rate.add_argument(
        "--component",
        action="append",
        metavar="NAME=COUNT@MTTF",
        help="a part whose failure stops the job, e.g. gpu=16384@50000h (repeat for each kind)",
    )
    interval = parser.add_argument_group("interval")
    interval.add_argument(
        "--checkpoint-cost", metavar="DURATION", help="time one save blocks training (C in Young/Daly)"
    )
    interval.add_argument(
        "--restart", default="0", metavar="DURATION", help="time from a failure until training runs again"
    )
    interval.add_argument(
        "--formula", type=Formula, default=Formula.DALY, metavar="{young,daly}", help="optimum (default daly)"
    )
    fixed = interval.add_mutually_exclusive_group()
    fixed.add_argument("--period", metavar="DURATION", help="fix the save-to-save period instead")
    fixed.add_argument(
        "--checkpoints-per-mttf", type=float, metavar="K", help="fix the period to cluster MTTF / K instead"
    )
    tiers = parser.add_argument_group("storage tiers")
    tiers.add_argument(
        "--tier",
        action="append",
        metavar="NAME[,every=N][,bw=BW]",
        help="a tier taking every N-th checkpoint at write bandwidth BW, e.g. durable,every=4,bw=10GB/s",
    )
    tiers.add_argument("--storage-bw", metavar="BW", help="one tier 'storage' taking every checkpoint at BW")
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--range", default="8:131072", metavar="MIN:MAX", help="accelerator counts (default 8:131072)")
    sweep.add_argument(
        "--points", type=int, default=15, metavar="N", help="log-spaced points (default 15: powers of two)"
    )
    sweep.add_argument("--plot", metavar="FILE", help="write a PNG of MTTF and interval vs accelerators")
    add_json_flag(parser)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace, out: Output) -> int:
    if args.mode is PlanMode.PRESETS:
        return _presets(out)
    if args.mode is not PlanMode.SWEEP and args.plot:
        raise ConfigError("--plot draws a sweep: use 'tiersave plan sweep --plot FILE'")
    inputs = _Inputs.from_args(args)
    if args.mode is PlanMode.SWEEP:
        return _sweep(inputs, args, out)
    return _report(inputs, out)


# ------------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True, kw_only=True, slots=True)
class _Inputs:
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
    def from_args(cls, args: argparse.Namespace) -> _Inputs:
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
            notes.append(f"checkpoint size {_bytes(checkpoint_bytes)} (given)")
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


# ------------------------------------------------------------------------------------------------- report


def _report(inputs: _Inputs, out: Output) -> int:
    if inputs.checkpoint_bytes is None and inputs.failure is None:
        raise ConfigError(
            "nothing to plan: give a model (--model, --params or --size) and/or a failure rate "
            "(--cluster-mttf, --accelerator-mttf, --observed or --component); see tiersave plan --help"
        )
    data: dict[str, Any] = {"size": None, "interval": None, "bandwidth": None}
    sections: list[str] = []
    if inputs.size is not None:
        data["size"] = _size_json(inputs.size)
        sections.append(_size_text(inputs.size))
    elif inputs.checkpoint_bytes is not None:
        data["size"] = {"total_bytes": inputs.checkpoint_bytes}
    if inputs.failure is not None:
        plan = inputs.interval(inputs.failure)
        data["interval"] = _interval_json(plan)
        sections.append(_interval_text(plan))
        if inputs.checkpoint_bytes is not None:
            load = plan_bandwidth(inputs.checkpoint_bytes, plan.period_s, inputs.accelerators, inputs.tiers)
            data["bandwidth"] = _bandwidth_json(load)
            sections.append(_bandwidth_text(load))
    data["assumptions"] = list(inputs.assumptions)
    sections.append("Assumptions\n" + "\n".join(f"- {line}" for line in inputs.assumptions))
    out.emit(data, "\n\n".join(sections))
    return EXIT_OK


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _bytes(n: float) -> str:
    return f"{format_si_bytes(n)} ({human_bytes(n)})"


def _num(value: float) -> str:
    return f"{value:,.1f}" if value < 1000 else f"{value:,.0f}"


def _size_json(size: CheckpointSize) -> dict[str, Any]:
    layout = size.parallelism
    return {
        "model": size.model.name if size.model else None,
        "params": size.params,
        "recipe": size.recipe.name,
        "bytes_per_param": size.recipe.bytes_per_param,
        "total_bytes": size.total_bytes,
        "components": [
            {
                "name": c.component.name,
                "dtype": c.component.dtype or None,
                "bytes_per_param": c.component.bytes_per_param,
                "total_bytes": c.total_bytes,
                "rank_held_bytes": c.rank_held_bytes,
                "sharded_over_dp": c.sharded_over_dp,
            }
            for c in size.components
        ],
        "parallelism": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "zero_stage": layout.zero_stage},
        "rank_held_bytes": size.rank_held_bytes,
        "rank_written_bytes": size.rank_written_bytes,
    }


def _size_text(size: CheckpointSize) -> str:
    subject = size.model.name if size.model else f"{size.params:,} parameters"
    head = (
        f"Checkpoint size: {subject} ({size.params / 1e9:.2f} B params), recipe {size.recipe.name} "
        f"({size.recipe.bytes_per_param:g} bytes/param)"
    )
    rows = [
        [
            c.component.label,
            f"{c.component.bytes_per_param:g}",
            _bytes(c.total_bytes),
            human_bytes(c.rank_held_bytes),
        ]
        for c in size.components
    ]
    rows.append(
        [
            "total",
            f"{size.recipe.bytes_per_param:g}",
            _bytes(size.total_bytes),
            human_bytes(size.rank_held_bytes),
        ]
    )
    grid = table(["component", "bytes/param", "checkpoint", "per rank (held)"], rows)
    tail = (
        f"layout {size.parallelism.describe()}: the most loaded rank holds "
        f"{human_bytes(size.rank_held_bytes)} and writes {human_bytes(size.rank_written_bytes)}"
    )
    return f"{head}\n{grid}\n{tail}"


def _interval_json(plan: IntervalPlan) -> dict[str, Any]:
    return {
        "accelerators": plan.failure.accelerators,
        "accelerator_mttf_s": plan.failure.accelerator_mttf_s,
        "cluster_mttf_s": plan.failure.cluster_mttf_s,
        "interruptions_per_day": plan.failure.interruptions_per_day,
        "cost_s": plan.cost_s,
        "restart_s": plan.restart_s,
        "young_interval_s": plan.young_interval_s,
        "daly_interval_s": plan.daly_interval_s,
        "interval_s": plan.interval_s,
        "period_s": plan.period_s,
        "chosen_by": plan.chosen_by,
        "checkpoints_per_mttf": plan.checkpoints_per_mttf,
        "checkpoints_per_day": plan.checkpoints_per_day,
        "goodput": plan.goodput,
    }


def _mttf(seconds: float) -> str:
    """Long MTTFs read in years, and are quoted in hours by vendors and papers: give both."""
    text = format_duration(seconds)
    return f"{text} ({seconds / 3600:,.0f} h)" if seconds >= 3 * SECONDS_PER_DAY else text


def _maybe(value: float | None, fmt: Callable[[float], str] = format_duration) -> str:
    return "-" if value is None else fmt(value)


def _interval_text(plan: IntervalPlan) -> str:
    f = plan.failure
    goodput = "-" if plan.goodput is None else f"{plan.goodput:.2%} (waste {1 - plan.goodput:.2%})"
    rows = [
        ["accelerators", f"{f.accelerators:,}"],
        ["MTTF per accelerator", _mttf(f.accelerator_mttf_s)],
        [
            "cluster MTTF",
            f"{format_duration(f.cluster_mttf_s)} ({_num(f.interruptions_per_day)} interruptions/day)",
        ],
        ["checkpoint cost C", _maybe(plan.cost_s)],
        ["restart time R", format_duration(plan.restart_s)],
        ["Young interval sqrt(2CM)", _maybe(plan.young_interval_s)],
        ["Daly interval", _maybe(plan.daly_interval_s)],
        ["period, save to save", f"{format_duration(plan.period_s)} ({plan.chosen_by})"],
        ["checkpoints per MTTF", _num(plan.checkpoints_per_mttf)],
        ["checkpoints per day", _num(plan.checkpoints_per_day)],
        ["expected goodput", goodput],
    ]
    return "Failures and interval\n" + table(["quantity", "value"], rows)


def _bandwidth_json(load: BandwidthPlan) -> dict[str, Any]:
    return {
        "checkpoint_bytes": load.checkpoint_bytes,
        "period_s": load.period_s,
        "checkpoints_per_day": load.checkpoints_per_day,
        "bytes_per_day": load.bytes_per_day,
        "bytes_per_s": load.bytes_per_s,
        "bytes_per_s_per_accelerator": load.bytes_per_s_per_accelerator,
        "tiers": [
            {
                "name": t.tier.name,
                "every": t.tier.every,
                "bandwidth_bytes_per_s": t.tier.bandwidth_bytes_per_s,
                "checkpoints_per_day": t.checkpoints_per_day,
                "bytes_per_day": t.bytes_per_day,
                "required_bytes_per_s": t.required_bytes_per_s,
                "required_bytes_per_s_per_accelerator": t.required_bytes_per_s_per_accelerator,
                "drain_s": t.drain_s,
                "keeps_up": t.keeps_up,
                "min_every": t.min_every,
            }
            for t in load.tiers
        ],
    }


def _bandwidth_text(load: BandwidthPlan) -> str:
    head = (
        f"Bandwidth: {format_si_bytes(load.checkpoint_bytes)} every {format_duration(load.period_s)} = "
        f"{_num(load.checkpoints_per_day)} checkpoints, {format_si_bytes(load.bytes_per_day)} per day; "
        f"{format_si_bytes(load.bytes_per_s, '/s')} sustained, "
        f"{format_si_bytes(load.bytes_per_s_per_accelerator, '/s')} per accelerator"
    )
    rows = []
    for t in load.tiers:
        verdict = "-" if t.keeps_up is None else "yes" if t.keeps_up else f"no: needs every={t.min_every}"
        rows.append(
            [
                t.tier.name,
                str(t.tier.every),
                _num(t.checkpoints_per_day),
                format_si_bytes(t.bytes_per_day),
                format_si_bytes(t.required_bytes_per_s, "/s"),
                format_si_bytes(t.required_bytes_per_s_per_accelerator, "/s"),
                _maybe(t.tier.bandwidth_bytes_per_s, lambda v: format_si_bytes(v, "/s")),
                _maybe(t.drain_s),
                verdict,
            ]
        )
    headers = ["tier", "every", "ckpts/day", "bytes/day", "needs", "per accel", "has", "drain", "keeps up"]
    return f"{head}\n{table(headers, rows)}"


# -------------------------------------------------------------------------------------------------- sweep


def _sweep(inputs: _Inputs, args: argparse.Namespace, out: Output) -> int:
    if inputs.failure is None:
        raise ConfigError(
            "a sweep needs a failure rate: --accelerator-mttf, --observed, --component or --cluster-mttf "
            "(with --accelerators, to get the rate per accelerator)"
        )
    if args.accelerators is None and (args.cluster_mttf is not None or args.component):
        raise ConfigError(
            "a sweep scales the failure rate per accelerator: give --accelerators for the cluster that "
            "--cluster-mttf or --component describes, or use --accelerator-mttf or --observed"
        )
    counts = _sweep_counts(args.range, args.points)
    rows_json: list[dict[str, Any]] = []
    for count in counts:
        plan = inputs.interval(inputs.failure.scaled_to(count))
        row = _interval_json(plan)
        if inputs.checkpoint_bytes is not None:
            row["bytes_per_s"] = inputs.checkpoint_bytes / plan.period_s
        rows_json.append(row)
    headers = ["accelerators", "cluster MTTF", "Young", "Daly", "period", "ckpts/day", "goodput"]
    if inputs.checkpoint_bytes is not None:
        headers.append("bandwidth")
    rows = []
    for row in rows_json:
        cells = [
            f"{row['accelerators']:,}",
            format_duration(row["cluster_mttf_s"]),
            _maybe(row["young_interval_s"]),
            _maybe(row["daly_interval_s"]),
            format_duration(row["period_s"]),
            _num(row["checkpoints_per_day"]),
            _maybe(row["goodput"], lambda g: f"{g:.2%}"),
        ]
        if "bytes_per_s" in row:
            cells.append(format_si_bytes(row["bytes_per_s"], "/s"))
        rows.append(cells)
    text = [
        f"Sweep over cluster sizes, MTTF per accelerator {_mttf(inputs.failure.accelerator_mttf_s)}",
        table(headers, rows),
    ]
    data: dict[str, Any] = {
        "accelerator_mttf_s": inputs.failure.accelerator_mttf_s,
        "points": rows_json,
        "plot": args.plot,
        "assumptions": list(inputs.assumptions),
    }
    if args.plot:
        _plot(rows_json, args.plot, inputs.failure, inputs.cost_s)
        text.append(f"wrote {args.plot}")
    text.append("Assumptions\n" + "\n".join(f"- {line}" for line in inputs.assumptions))
    out.emit(data, "\n\n".join(text))
    return EXIT_OK


def _sweep_counts(spec: str, points: int) -> list[int]:
    low_text, sep, high_text = spec.partition(":")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        raise ConfigError(f"--range {spec!r}: expected MIN:MAX accelerator counts such as 8:100000") from None
    if not sep or low < 1 or high < low:
        raise ConfigError(f"--range {spec!r}: expected 1 <= MIN <= MAX")
    if points < 2 or points > 1000:
        raise ConfigError(f"--points must be between 2 and 1000, got {points}")
    ratio = (high / low) ** (1 / (points - 1))
    return sorted({round(low * ratio**i) for i in range(points)})


def _plot(rows: list[dict[str, Any]], path: str, failure: FailureModel, cost_s: float | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailableError("plotting needs matplotlib: pip install 'tiersave[bench]'") from None
    x = [r["accelerators"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    left.plot(x, [r["cluster_mttf_s"] / 3600 for r in rows], marker="o")
    left.set(xscale="log", yscale="log", xlabel="accelerators", ylabel="cluster MTTF (hours)")
    left.set_title("Cluster MTTF")
    right.set(xscale="log", xlabel="accelerators", ylabel="minutes")
    if cost_s is not None:
        right.plot(x, [r["young_interval_s"] / 60 for r in rows], marker="o", label="Young sqrt(2CM)")
        right.plot(x, [r["daly_interval_s"] / 60 for r in rows], marker="s", label="Daly")
        right.set_title(f"Optimal interval (C = {format_duration(cost_s)})")
    else:
        right.plot(x, [r["period_s"] / 60 for r in rows], marker="o", label="period")
        right.set_title("Checkpoint period")
    right.set_yscale("log")
    right.legend()
    for axis in (left, right):
        axis.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"MTTF per accelerator {_mttf(failure.accelerator_mttf_s)}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------ presets


def _presets(out: Output) -> int:
    models = [
        {
            "name": a.name,
            "params": a.param_count,
            "layers": a.layers,
            "hidden": a.hidden,
            "ffn_hidden": a.ffn_hidden,
            "heads": a.heads,
            "kv_heads": a.kv_heads,
            "vocab": a.vocab,
            "source": a.source,
        }
        for a in PRESETS.values()
    ]
    recipes = [
        {
            "name": r.name,
            "bytes_per_param": r.bytes_per_param,
            "components": {c.label: c.bytes_per_param for c in r.components},
            "description": r.description,
        }
        for r in RECIPES.values()
    ]
    model_rows = [
        [a.name, f"{a.param_count / 1e9:.2f} B"]
        + [str(n) for n in (a.layers, a.hidden, a.ffn_hidden, a.heads, a.kv_heads, a.vocab)]
        for a in PRESETS.values()
    ]
    recipe_rows = [
        [
            r.name,
            f"{r.bytes_per_param:g}",
            " + ".join(f"{c.label} {c.bytes_per_param:g}" for c in r.components),
        ]
        for r in RECIPES.values()
    ]
    text = "\n\n".join(
        [
            "Model presets\n"
            + table(["preset", "params", "layers", "hidden", "ffn", "heads", "kv", "vocab"], model_rows),
            "Precision recipes\n" + table(["recipe", "bytes/param", "components"], recipe_rows),
        ]
    )
    out.emit({"models": models, "recipes": recipes}, text)
    return EXIT_OK
