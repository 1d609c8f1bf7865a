"""``tiersave plan`` results as tables and JSON: one job, a sweep over cluster sizes, the presets.

Scope: run the planner on the parsed inputs and emit each section (checkpoint size, failures and
interval, bandwidth per tier, assumptions) as text and as JSON; the sweep over accelerator counts with its
optional PNG (matplotlib imported only then); the list of model presets and precision recipes.

Anti-scope: parsing the command line (:mod:`tiersave.cli.plan_inputs`), the planner arithmetic
(:mod:`tiersave.planner`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..errors import BackendUnavailableError, ConfigError
from ..planner.architecture import PRESETS
from ..planner.bandwidth import BandwidthPlan, plan_bandwidth
from ..planner.failures import FailureModel
from ..planner.interval import IntervalPlan
from ..planner.recipes import RECIPES
from ..planner.sizing import CheckpointSize
from ..units import SECONDS_PER_DAY, format_duration, format_si_bytes, human_bytes, table
from ._common import EXIT_OK, Output
from .plan_inputs import PlanInputs, si_and_binary_bytes

__all__ = ["presets", "report", "sweep"]


def report(inputs: PlanInputs, out: Output) -> int:
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
            si_and_binary_bytes(c.total_bytes),
            human_bytes(c.rank_held_bytes),
        ]
        for c in size.components
    ]
    rows.append(
        [
            "total",
            f"{size.recipe.bytes_per_param:g}",
            si_and_binary_bytes(size.total_bytes),
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


def sweep(inputs: PlanInputs, args: argparse.Namespace, out: Output) -> int:
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


def presets(out: Output) -> int:
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
