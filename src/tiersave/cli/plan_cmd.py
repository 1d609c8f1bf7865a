"""``tiersave plan``: checkpoint size, cluster MTTF, optimal interval and bandwidth, as a table or JSON.

Scope: the command's arguments, help and examples (:func:`register`) and the choice of mode. The command
line becomes planner objects in :mod:`tiersave.cli.plan_inputs`; the results become tables and JSON in
:mod:`tiersave.cli.plan_report`.

Anti-scope: any planner arithmetic (:mod:`tiersave.planner`); parsing the values of the options.

Imports only the standard library and the torch-free planner modules, so it starts fast anywhere;
matplotlib is imported only when ``sweep --plot`` asks for a figure.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import ConfigError
from ..planner.interval import Formula
from ._common import Output, add_json_flag
from .plan_inputs import PlanInputs, PlanMode
from .plan_report import presets, report, sweep

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
    add_job_arguments(parser)
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--range", default="8:131072", metavar="MIN:MAX", help="accelerator counts (default 8:131072)")
    sweep.add_argument(
        "--points", type=int, default=15, metavar="N", help="log-spaced points (default 15: powers of two)"
    )
    sweep.add_argument("--plot", metavar="FILE", help="write a PNG of MTTF and interval vs accelerators")
    add_json_flag(parser)
    parser.set_defaults(handler=_run)


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that describe a job: checkpoint size, layout, failure rate, interval and tiers.

    ``tiersave simulate`` takes the same options, parsed by the same :class:`PlanInputs`.
    """
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


def _run(args: argparse.Namespace, out: Output) -> int:
    if args.mode is PlanMode.PRESETS:
        return presets(out)
    if args.mode is not PlanMode.SWEEP and args.plot:
        raise ConfigError("--plot draws a sweep: use 'tiersave plan sweep --plot FILE'")
    inputs = PlanInputs.from_args(args)
    if args.mode is PlanMode.SWEEP:
        return sweep(inputs, args, out)
    return report(inputs, out)
