"""Where the memory tier and the peer replica matter: goodput of the seeds' job against the restart cost.

The job of docs/planning.md section 8 (24,000 accelerators, a failure every 124 minutes, a 4.87 TB
checkpoint, saves blocking 2 s when asynchronous), simulated with `tiersave.planner.simulate` for each
rescheduling time (the part of a restart before the checkpoint is read) and two durable bandwidths. Prints
a table and writes a PNG with the goodput of every strategy and the goodput points the memory tier (with
its replica) and the peer replica alone add.

    PYTHONPATH=src python benchmarks/simulate_restart_sweep.py --out docs/simulate-restart.png
"""

from __future__ import annotations

import argparse

from tiersave.planner.bandwidth import TierSpec
from tiersave.planner.simulate import FailureSpec, compare
from tiersave.planner.simulate_strategies import JobSpec, build_strategies

NAMES = ["fixed", "young", "async", "tiered-nopeer", "tiered"]
RESTARTS_MIN = [0.25, 0.5, 1, 2, 5, 10, 20, 30]
BANDWIDTHS = [100e9, 25e9]


def sweep(days: float, runs: int, seed: int) -> dict[float, dict[float, dict[str, float]]]:
    out: dict[float, dict[float, dict[str, float]]] = {}
    for bandwidth in BANDWIDTHS:
        out[bandwidth] = {}
        for minutes in RESTARTS_MIN:
            job = JobSpec(
                mttf_s=124 * 60.0,
                accelerators=24_000,
                checkpoint_bytes=4_870_000_000_000,
                stage_cost_s=2.0,
                reschedule_s=minutes * 60.0,
                fixed_period_s=6.2 * 60.0 if bandwidth >= 100e9 else 12.4 * 60.0,
                tiers=(TierSpec(name="durable", bandwidth_bytes_per_s=bandwidth),),
            )
            strategies, _ = build_strategies(job, NAMES)
            result = compare(strategies, FailureSpec(mttf_s=job.mttf_s), days=days, runs=runs, seed=seed)
            out[bandwidth][minutes] = {r.strategy.name: r.goodput for r in result.results}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=float, default=100.0)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="PNG to write")
    args = parser.parse_args()
    data = sweep(args.days, args.runs, args.seed)
    for bandwidth, rows in data.items():
        print(f"durable {bandwidth / 1e9:g} GB/s: goodput (%) by rescheduling time")
        print("restart   " + "".join(f"{n:>15}" for n in NAMES) + "   memory+peer   peer")
        for minutes, g in rows.items():
            cells = "".join(f"{100 * g[n]:15.2f}" for n in NAMES)
            gains = f"{100 * (g['tiered'] - g['async']):14.2f}{100 * (g['tiered'] - g['tiered-nopeer']):7.2f}"
            print(f"{minutes:6g} min{cells}{gains}")
        print()
    if args.out:
        plot(data, args.out)
        print(f"wrote {args.out}")


def plot(data: dict[float, dict[float, dict[str, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    fast = data[BANDWIDTHS[0]]
    for name in NAMES:
        left.plot(RESTARTS_MIN, [100 * fast[m][name] for m in RESTARTS_MIN], marker="o", ms=3, label=name)
    left.set(xscale="log", xlabel="rescheduling time (min)", ylabel="goodput (%)")
    left.set_title(f"Goodput, durable {BANDWIDTHS[0] / 1e9:g} GB/s", fontsize=10)
    left.legend(fontsize=8)
    for bandwidth, style in zip(BANDWIDTHS, ("-", "--"), strict=True):
        rows = data[bandwidth]
        label = f"{bandwidth / 1e9:g} GB/s"
        right.plot(
            RESTARTS_MIN,
            [100 * (rows[m]["tiered"] - rows[m]["async"]) for m in RESTARTS_MIN],
            style,
            marker="o",
            ms=3,
            color="tab:blue",
            label=f"memory tier + peer (tiered - async), {label}",
        )
        right.plot(
            RESTARTS_MIN,
            [100 * (rows[m]["tiered"] - rows[m]["tiered-nopeer"]) for m in RESTARTS_MIN],
            style,
            marker="s",
            ms=3,
            color="tab:orange",
            label=f"peer replica (tiered - tiered-nopeer), {label}",
        )
    right.set(xscale="log", xlabel="rescheduling time (min)", ylabel="goodput points gained", ylim=(0, 7.5))
    right.set_title("What the tiers add", fontsize=10)
    right.legend(fontsize=7, loc="upper right")
    for axis in (left, right):
        axis.grid(True, which="both", alpha=0.3)
    fig.suptitle("24,000 accelerators, MTTF 124 min, 4.87 TB, half the failures lose a node", fontsize=10)
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
