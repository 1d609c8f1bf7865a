"""How fast the goodput simulator runs: 10^3 simulated days of the seeds' 24,000-accelerator job.

The target (issue 14) is 1,000 simulated days in under 10 s. This runs the four default strategies on
the same 1,000 days of failures (10 traces of 100 days: the figures `tiersave simulate --days 100 --runs 10`
prints), so every strategy covers 1,000 days, and reports the wall time of the whole comparison and per
strategy, best of ``--repeat``.

    PYTHONPATH=src python benchmarks/simulate_speed.py [--days 100] [--runs 10] [--repeat 3]
"""

from __future__ import annotations

import argparse
import random
import time

from tiersave.planner.bandwidth import TierSpec
from tiersave.planner.simulate import FailureSpec, compare, failure_trace, run_trace
from tiersave.planner.simulate_strategies import JobSpec, build_strategies

JOB = JobSpec(
    mttf_s=124 * 60.0,
    accelerators=24_000,
    checkpoint_bytes=4_870_000_000_000,
    stage_cost_s=2.0,
    reschedule_s=300.0,
    fixed_period_s=372.0,
    tiers=(TierSpec(name="durable", bandwidth_bytes_per_s=100e9),),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=float, default=100.0)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    strategies, _ = build_strategies(JOB)
    failures = FailureSpec(mttf_s=JOB.mttf_s)
    best = float("inf")
    for _ in range(args.repeat):
        started = time.perf_counter()
        result = compare(strategies, failures, days=args.days, runs=args.runs, seed=0)
        best = min(best, time.perf_counter() - started)
    total_days = args.days * args.runs
    print(
        f"{len(strategies)} strategies x {total_days:g} simulated days "
        f"({sum(result.failures_per_run):,} failures): {best:.2f} s (best of {args.repeat})"
    )
    horizon = args.days * 86_400.0
    traces = [failure_trace(failures, horizon, random.Random(i)) for i in range(args.runs)]
    for strategy, r in zip(strategies, result.results, strict=True):
        timings = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            for times, kinds in traces:
                run_trace(strategy, times, kinds, horizon)
            timings.append(time.perf_counter() - started)
        saves = r.total("saves")
        print(
            f"  {strategy.name:<8} {min(timings):6.2f} s for {total_days:g} days, {saves:,.0f} saves, "
            f"goodput {r.goodput:.2%} [{r.goodput_ci95[0]:.2%}, {r.goodput_ci95[1]:.2%}]"
        )


if __name__ == "__main__":
    main()
