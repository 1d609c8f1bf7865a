"""``tiersave simulate``: what checkpointing strategies cost a job under failures, simulated, as a table or JSON.

Scope: the command's arguments (the job options of ``tiersave plan``, parsed by the same
:class:`~tiersave.cli.plan_inputs.PlanInputs`, plus the simulation's own), filling unset options from a
``tiersave plan --json`` document (``--plan``) or from a checkpoint root's measured saves (``--from``),
running :func:`tiersave.planner.simulate.compare` and reporting per strategy, with an optional PNG.

Anti-scope: the simulation and the strategies (:mod:`tiersave.planner.simulate`,
:mod:`tiersave.planner.simulate_strategies`); the value parsing of the job options
(:mod:`tiersave.cli.plan_inputs`). Imports no torch; matplotlib only for ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailableError, ConfigError
from ..planner.simulate import NODE_LOSS, Comparison, FailureSpec, StrategyResult, compare
from ..planner.simulate_strategies import ALL_STRATEGIES, JobSpec, build_strategies
from ..units import format_duration, format_si_bytes, parse_duration, table
from ._common import EXIT_OK, Output, add_json_flag, positive_int
from .plan_cmd import add_job_arguments
from .plan_inputs import PlanInputs

__all__ = ["register"]

_EPILOG = """\
strategies (default: fixed, young, async, tiered; all run on the same failure traces):
  fixed          synchronous saves to durable storage every --period (default MTTF / 20)
  young          the same at the Young/Daly optimum (--formula) for that save's cost
  async          one durable tier, asynchronous: blocks for --stage-cost, written in the background
  tiered         memory at the optimum for --stage-cost, a peer replica, durable every N-th save
  tiered-nopeer  the same without the peer replica

tiers are told apart by name: memory/mem/shm, local/disk/nvme, peer/replica, anything else is durable;
a read is taken to be as fast as a write. --restart is the time before the checkpoint is read
(detect, reschedule, start); the read from the tier restored from is added.

examples:
  # the seeds' example: 24,000 accelerators, a failure every 124 min, a 4.87 TB checkpoint
  tiersave simulate --size 4.87TB --accelerators 24000 --cluster-mttf 124min --restart 5min \\
      --tier durable,bw=100GB/s --stage-cost 2s --period 6.2min --days 100
  # from a plan, with Weibull failures (clustered: shape 0.7) and a plot
  tiersave plan --model llama3-405b --accelerators 16384 --observed 419,54,16384 \\
      --storage-bw 50GB/s --json > plan.json
  tiersave simulate --plan plan.json --weibull 0.7 --plot goodput.png
  # measured save costs of a checkpoint root, on a given failure record
  tiersave simulate --from /ckpt/run1 --accelerators 4096 --observed 419,54,16384
"""

_RATE_FLAGS = ("cluster_mttf", "accelerator_mttf", "observed", "component")
_SIZE_FLAGS = ("size", "model", "params")


def register(subparsers: Any) -> None:
    """Add the ``simulate`` subcommand to the ``tiersave`` parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="simulate checkpointing strategies under failures: goodput, time lost, bytes per tier",
        description=(
            "Simulate a long training job under failures and compare checkpointing strategies on the\n"
            "same failure traces: goodput with a 95% interval over repeated traces, time lost to\n"
            "re-computation, blocking saves and restarts, bytes written per tier, accelerator-hours\n"
            "saved against fixed-period saves. The model and its validation: docs/planning.md."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_job_arguments(parser)
    parser.set_defaults(mode=None, restart=None)  # --restart may come from --plan
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--plan", metavar="FILE", help="a 'tiersave plan --json' document: fills unset options")
    sim.add_argument(
        "--from",
        dest="from_root",
        metavar="ROOT",
        help="a checkpoint root whose measured saves (its event log, else its manifests) give the save costs",
    )
    sim.add_argument(
        "--stage-cost", metavar="DURATION", help="time an asynchronous save blocks training (default size / memory bw)"
    )
    sim.add_argument(
        "--node-loss", type=float, default=0.5, metavar="SHARE", help="share of failures losing a node (default 0.5)"
    )
    sim.add_argument(
        "--weibull", type=float, metavar="K", help="Weibull inter-arrival times of shape K (default exponential)"
    )
    sim.add_argument(
        "--failures",
        metavar="FILE",
        help="replay failure times: one per line, a duration from the start, optionally followed by crash or node",
    )
    sim.add_argument("--days", type=float, default=30.0, metavar="D", help="simulated days per run (default 30)")
    sim.add_argument("--runs", type=positive_int, default=10, metavar="N", help="independent traces (default 10)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the first trace (default 0)")
    sim.add_argument(
        "--strategy",
        action="append",
        choices=ALL_STRATEGIES,
        metavar="NAME",
        help=f"a strategy to simulate, repeatable: {', '.join(ALL_STRATEGIES)} (default all but tiered-nopeer)",
    )
    sim.add_argument("--plot", metavar="FILE", help="write a PNG: goodput per strategy, and against cluster size")
    add_json_flag(parser)
    parser.set_defaults(handler=_run)


# -------------------------------------------------------------------------------------------------- inputs


def _fill_from_plan(args: argparse.Namespace, path: str) -> list[str]:
    """Set the options the command line left unset from a ``tiersave plan --json`` document."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--plan {path!r}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--plan {path!r}: not a JSON document ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("interval") or {}, dict):
        raise ConfigError(f"--plan {path!r}: not a 'tiersave plan --json' document")
    interval = doc.get("interval") or {}
    size = doc.get("size") or {}
    bandwidth = doc.get("bandwidth") or {}
    if not interval and not size:
        raise ConfigError(f"--plan {path!r}: the document has neither an interval nor a size section")
    try:
        if interval and not any(getattr(args, f) for f in _RATE_FLAGS):
            args.cluster_mttf = repr(float(interval["cluster_mttf_s"]))
            if args.accelerators is None:
                args.accelerators = int(interval["accelerators"])
        if interval.get("cost_s") is not None and args.checkpoint_cost is None:
            args.checkpoint_cost = repr(float(interval["cost_s"]))
        if interval.get("restart_s") is not None and args.restart is None:
            args.restart = repr(float(interval["restart_s"]))
        if interval.get("period_s") is not None and args.period is None and args.checkpoints_per_mttf is None:
            args.period = repr(float(interval["period_s"]))
        if size.get("total_bytes") is not None and not any(getattr(args, f) for f in _SIZE_FLAGS):
            args.size = str(int(size["total_bytes"]))
        if bandwidth.get("tiers") and not args.tier and args.storage_bw is None:
            args.tier = [
                _tier_text(t["name"], int(t.get("every") or 1), t.get("bandwidth_bytes_per_s"))
                for t in bandwidth["tiers"]
            ]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"--plan {path!r}: malformed plan document ({exc!r})") from None
    return [f"job from the plan {path} where the command line left it unset"]


def _tier_text(name: str, every: int, bandwidth: float | None) -> str:
    text = f"{name},every={every}"
    return text if bandwidth is None else f"{text},bw={int(bandwidth)}"


def _fill_from_root(args: argparse.Namespace, root: str) -> list[str]:
    """Set the stage cost, size and tier bandwidths the command line left unset from measured saves."""
    events, where = _measured_saves(root)
    saves = [e for e in events if e.get("outcome") == "committed" and _number(e.get("blocked_s")) is not None]
    if not saves:
        raise ConfigError(f"--from {root!r}: no committed saves with statistics in {where}")
    notes = []
    blocked = sum(float(e["blocked_s"]) for e in saves) / len(saves)
    if args.stage_cost is None:
        args.stage_cost = repr(blocked)
        notes.append(f"stage cost {format_duration(blocked)}: mean time blocked over {len(saves)} saves in {root}")
    sizes = [int(e["stored_bytes"]) for e in saves if isinstance(e.get("stored_bytes"), int) and e["stored_bytes"] > 0]
    if sizes and not any(getattr(args, f) for f in _SIZE_FLAGS):
        args.size = str(sum(sizes) // len(sizes))
        notes.append(f"checkpoint size {format_si_bytes(sum(sizes) / len(sizes))}: mean over the saves in {root}")
    if not args.tier and args.storage_bw is None:
        rates: dict[str, list[float]] = {}
        first = str(saves[-1].get("tier") or "memory")
        for e in saves:
            gbps = _number(e.get("write_gbps"))
            if gbps:
                rates.setdefault(str(e.get("tier") or first), []).append(gbps * 1e9)
        for e in events:
            seconds, stored = _number(e.get("total_s")), _number(e.get("stored_bytes"))
            if e.get("outcome") == "drained" and seconds and stored:
                rates.setdefault(str(e.get("tier")), []).append(stored / seconds)
        args.tier = [_tier_text(name, 1, sum(v) / len(v)) for name, v in rates.items()]
        for name, v in rates.items():
            notes.append(f"tier {name}: {format_si_bytes(sum(v) / len(v), '/s')}, mean of {len(v)} measured writes")
    return notes


def _measured_saves(root: str) -> tuple[list[dict[str, Any]], str]:
    """The save records of a root: its event log when it has one, else the statistics in its manifests
    (an object-store root, or one saved without an event log)."""
    from ..events import EVENTS_NAME, read_events

    local = "://" not in root or root.startswith("file://")
    path = Path(root.removeprefix("file://"))
    if local and not path.is_dir():
        raise ConfigError(f"--from {root!r}: no such checkpoint root")
    if local and (path / EVENTS_NAME).exists():
        return read_events(path / EVENTS_NAME), str(path / EVENTS_NAME)
    from ..catalog import Catalog
    from ..storage import open_storage
    from ..tierspec import default_name

    storage = open_storage(root, create=False)
    catalog = Catalog(storage)
    tier = default_name(root, storage)
    records = [
        {**catalog.manifest(step).stats, "outcome": "committed", "tier": tier, "step": step} for step in catalog.steps()
    ]
    return records, f"the manifests under {root}"


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _replay(path: str) -> tuple[tuple[float, ...], tuple[int, ...] | None]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"--failures {path!r}: cannot read it ({exc.strerror or exc})") from None
    times: list[float] = []
    kinds: list[int] = []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            times.append(parse_duration(fields[0]))
        except ConfigError as exc:
            raise ConfigError(f"--failures {path}:{number}: {exc}") from None
        if len(fields) > 1:
            if fields[1] not in ("crash", "node"):
                raise ConfigError(f"--failures {path}:{number}: the kind must be crash or node, got {fields[1]!r}")
            kinds.append(NODE_LOSS if fields[1] == "node" else 0)
    if kinds and len(kinds) != len(times):
        raise ConfigError(f"--failures {path}: give a kind on every line or on none")
    return tuple(times), (tuple(kinds) if kinds else None)


def _job(args: argparse.Namespace) -> tuple[JobSpec, FailureSpec, list[str]]:
    notes: list[str] = []
    if args.plan:
        notes += _fill_from_plan(args, args.plan)
    if args.from_root:
        notes += _fill_from_root(args, args.from_root)
    if args.restart is None:
        args.restart = "0"
    inputs = PlanInputs.from_args(args)
    if inputs.failure is None:
        raise ConfigError(
            "simulate needs a failure rate: --cluster-mttf, --accelerator-mttf, --observed or --component "
            "(or --plan FILE)"
        )
    mttf = inputs.failure.cluster_mttf_s
    period = inputs.period_s
    if period is None and inputs.checkpoints_per_mttf is not None:
        period = mttf / inputs.checkpoints_per_mttf
    if not (0.0 <= args.node_loss <= 1.0):
        raise ConfigError(f"--node-loss must be a share in [0, 1], got {args.node_loss:g}")
    days = args.days
    if not (math.isfinite(days) and 0 < days <= 1e6):
        raise ConfigError(f"--days must be a number of days in (0, 1e6], got {days:g}")
    replay, kinds = _replay(args.failures) if args.failures else (None, None)
    if replay is not None and args.weibull is not None:
        raise ConfigError("--failures replays given times: --weibull does not apply")
    job = JobSpec(
        mttf_s=mttf,
        accelerators=inputs.accelerators,
        checkpoint_bytes=inputs.checkpoint_bytes,
        sync_cost_s=inputs.cost_s if args.checkpoint_cost is not None else None,
        stage_cost_s=None if args.stage_cost is None else parse_duration(args.stage_cost),
        reschedule_s=inputs.restart_s,
        fixed_period_s=period,
        formula=inputs.formula,
        tiers=inputs.tiers,
    )
    failures = FailureSpec(
        mttf_s=mttf, weibull_shape=args.weibull, node_loss_share=args.node_loss, replay=replay, replay_kinds=kinds
    )
    kept = [a for a in inputs.assumptions if not a.startswith(("failures:", "goodput from", "checkpoint cost C"))]
    notes = kept + notes + [f"failures: {inputs.failure.source}; {failures.describe()}"]
    return job, failures, notes


# -------------------------------------------------------------------------------------------------- report


def _run(args: argparse.Namespace, out: Output) -> int:
    job, failures, notes = _job(args)
    strategies, strategy_notes = build_strategies(job, args.strategy)
    notes += strategy_notes
    notes.append(
        "restart = --restart (detect, reschedule) + the read of the newest usable checkpoint from the fastest "
        "tier holding it; a node loss empties memory and local disk; a failure may strike during a save, a "
        "background write or a restart"
    )
    show = _progress_bar(out, "simulating")
    result = compare(strategies, failures, days=args.days, runs=args.runs, seed=args.seed, progress=show)
    data = report_json(result, job)
    data["assumptions"] = notes
    text = [_text(result, job)]
    if args.plot:
        plot(result, job, args.plot, _progress_bar(out, "plotting"))
        data["plot"] = args.plot
        text.append(f"wrote {args.plot}")
    text.append("Assumptions\n" + "\n".join(f"- {line}" for line in notes))
    out.emit(data, "\n\n".join(text))
    return EXIT_OK


def _progress_bar(out: Output, what: str) -> Any:
    """A bar on stderr when it is a terminal (never in captured output or mixed into JSON)."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        filled = round(30 * done / total)
        sys.stderr.write(f"\r{what} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\r" + " " * (len(what) + 45) + "\r")
        sys.stderr.flush()

    return show


def _saved_hours(r: StrategyResult, base: StrategyResult | None, accelerators: int) -> float | None:
    """Accelerator-hours per simulated day that ``r`` wastes less than ``base``."""
    if base is None:
        return None
    return (r.goodput - base.goodput) * accelerators * 24.0


def report_json(result: Comparison, job: JobSpec) -> dict[str, Any]:
    """The comparison as the JSON document ``--json`` prints."""
    fixed = result.get("fixed")
    total_days = result.days * result.runs
    rows = []
    for r in result.results:
        s = r.strategy
        saved = _saved_hours(r, fixed, job.accelerators)
        rows.append(
            {
                "name": s.name,
                "description": s.description,
                "goodput": r.goodput,
                "goodput_ci95": list(r.goodput_ci95),
                "interval_s": s.interval_s,
                "blocked_s_per_save": s.blocked_s,
                "tiers": [
                    {"name": t.name, "every": t.every, "write_s": t.write_s, "restore_s": t.restore_s} for t in s.tiers
                ],
                "lost": {
                    "recompute": r.share("recompute_s"),
                    "blocked": r.share("blocked_s"),
                    "restart": r.share("restart_s"),
                },
                "saves_per_day": r.total("saves") / total_days,
                "bytes_per_day_by_tier": {k: v / total_days for k, v in r.bytes_by_tier.items()},
                "restores_by_tier": {
                    t.name: sum(tally.restores_by_tier[i] for tally in r.tallies) for i, t in enumerate(s.tiers)
                },
                "restarts_from_scratch": int(r.total("restarts_from_scratch")),
                "accelerator_hours_saved_vs_fixed_per_day": saved,
                "accelerator_hours_saved_vs_fixed": None if saved is None else saved * total_days,
            }
        )
    return {
        "days": result.days,
        "runs": result.runs,
        "seed": result.seed,
        "accelerators": job.accelerators,
        "cluster_mttf_s": job.mttf_s,
        "checkpoint_bytes": job.checkpoint_bytes,
        "failures": result.failures.describe(),
        "failures_per_day": sum(result.failures_per_run) / total_days,
        "strategies": rows,
    }


def _text(result: Comparison, job: JobSpec) -> str:
    fixed = result.get("fixed")
    head = (
        f"Simulated {result.runs} x {result.days:g} days of {job.accelerators:,} accelerators, cluster MTTF "
        f"{format_duration(job.mttf_s)} ({sum(result.failures_per_run) / (result.days * result.runs):.1f} "
        f"failures/day), seed {result.seed}"
    )
    rows = []
    for r in result.results:
        lo, hi = r.goodput_ci95
        saved = _saved_hours(r, fixed, job.accelerators)
        rows.append(
            [
                r.strategy.name,
                f"{r.goodput:.2%}",
                f"{lo:.2%} - {hi:.2%}",
                f"{r.share('recompute_s'):.2%}",
                f"{r.share('blocked_s'):.2%}",
                f"{r.share('restart_s'):.2%}",
                "-" if saved is None else f"{saved:,.0f}",
            ]
        )
    grid = table(["strategy", "goodput", "95% interval", "recompute", "blocked", "restart", "acc-h/day saved"], rows)
    detail = []
    days = result.days * result.runs
    for r in result.results:
        written = ", ".join(f"{k} {format_si_bytes(v / days)}" for k, v in r.bytes_by_tier.items())
        detail.append(f"- {r.strategy.name}: {r.strategy.description}; per day: {written}")
    return f"{head}\n{grid}\n\nStrategies\n" + "\n".join(detail)


def plot(result: Comparison, job: JobSpec, path: str, progress: Any = None) -> None:
    """Goodput per strategy (with its interval), and goodput against cluster size (1/8 to 8 times)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailableError("plotting needs matplotlib: pip install 'tiersave[bench]'") from None
    names = [r.strategy.name for r in result.results]
    sizes = sorted({max(1, round(job.accelerators * 2.0**k)) for k in range(-3, 4)})
    curves: dict[str, list[float]] = {n: [] for n in names}
    spec = result.failures
    for i, count in enumerate(sizes):
        scaled = job.scaled_to(count)
        strategies, _ = build_strategies(scaled, names)
        failures = FailureSpec(
            mttf_s=scaled.mttf_s,
            weibull_shape=spec.weibull_shape,
            node_loss_share=spec.node_loss_share,
            replay=spec.replay,
            replay_kinds=spec.replay_kinds,
        )
        point = compare(strategies, failures, days=result.days, runs=result.runs, seed=result.seed)
        for r in point.results:
            curves[r.strategy.name].append(r.goodput)
        if progress is not None:
            progress(i + 1, len(sizes))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    means = [r.goodput * 100 for r in result.results]
    errors = [[(r.goodput - r.goodput_ci95[0]) * 100 for r in result.results]]
    errors.append([(r.goodput_ci95[1] - r.goodput) * 100 for r in result.results])
    left.bar(names, means, yerr=errors, capsize=4, color="tab:blue")
    left.set(ylabel="goodput (%)", ylim=(max(0.0, min(means) - 10), 100))
    left.set_title(f"{job.accelerators:,} accelerators, MTTF {format_duration(job.mttf_s)}")
    for name in names:
        right.plot(sizes, [g * 100 for g in curves[name]], marker="o", label=name)
    right.set(xscale="log", xlabel="accelerators", ylabel="goodput (%)")
    right.set_title("Against cluster size (failure rate per accelerator kept)")
    right.legend()
    for axis in (left, right):
        axis.grid(True, alpha=0.3)
    fig.suptitle(f"{result.runs} x {result.days:g} simulated days, {spec.describe()}", fontsize=9)
    fig.savefig(path, dpi=100)
    plt.close(fig)
