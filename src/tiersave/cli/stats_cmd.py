"""``tiersave stats``: the timings of past saves (time blocked, staging, writing, commit, throughput), and what
incremental saves and drains referenced and compressed drains shrank."""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import Any

from ..units import human_bytes, table
from ._common import EXIT_OK, Output, add_json_flag


def register(sub: Any) -> None:
    p = sub.add_parser(
        "stats",
        help="timings of past saves: blocked, staged, written, committed",
        description="Show the save event log of a checkpoint root (ROOT/tiersave-events.jsonl): for each save, "
        "the time training was blocked, staging, background writing, commit, bytes and throughput; "
        "--plot draws, per run, a bar per save: the time training was blocked (log scale, ms) beside the whole save.",
    )
    p.add_argument("root")
    p.add_argument("--last", type=int, default=50, help="show the last N saves (default 50; 0 = all)")
    p.add_argument(
        "--plot", metavar="FILE", help="write a PNG: per run, training blocked per save beside the save's duration"
    )
    add_json_flag(p)
    p.set_defaults(handler=_stats)


def _ms(value: Any) -> str:
    return f"{1e3 * value:.1f}" if isinstance(value, (int, float)) else "-"


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    committed = [e for e in events if e.get("outcome") == "committed"]
    out: dict[str, Any] = {
        "saves": len(events),
        "committed": len(committed),
        "failed": sum(e.get("outcome") == "failed" for e in events),
        "skipped": sum(e.get("outcome") == "skipped" for e in events),
    }
    if committed:
        blocked = sorted(float(e.get("blocked_s", 0.0)) for e in committed)
        out["blocked_s_mean"] = sum(blocked) / len(blocked)
        out["blocked_s_p50"] = blocked[len(blocked) // 2]
        out["blocked_s_max"] = blocked[-1]
        out["total_s_mean"] = sum(float(e.get("total_s", 0.0)) for e in committed) / len(committed)
        out["bytes_mean"] = sum(int(e.get("stored_bytes", 0)) for e in committed) / len(committed)
    incremental = [e for e in committed if "referenced_bytes" in e]
    if incremental:  # what incremental saves did not write again
        out["incremental"] = {
            "saves": len(incremental),
            "bytes": sum(int(e.get("stored_bytes", 0)) for e in incremental),
            "referenced_bytes": sum(int(e["referenced_bytes"]) for e in incremental),
        }
    drains: dict[str, dict[str, int]] = {}
    for e in events:
        if e.get("outcome") == "drained" and "file_bytes" in e:  # what each tier's drains stored (compressed)
            tier = drains.setdefault(str(e.get("tier", "?")), {"drains": 0, "bytes": 0, "file_bytes": 0})
            tier["drains"] += 1
            tier["bytes"] += int(e.get("stored_bytes", 0))
            tier["file_bytes"] += int(e["file_bytes"])
            if "referenced_bytes" in e:  # an incremental drain: what it referenced on the tier, not copied
                tier["referenced_bytes"] = tier.get("referenced_bytes", 0) + int(e["referenced_bytes"])
    if drains:
        out["drains"] = drains
    return out


def _savings(summary: dict[str, Any]) -> str:
    """The bytes a run did not write: referenced by incremental saves, and shrunk by compressed drains."""
    lines = []
    inc = summary.get("incremental")
    if inc and inc["bytes"]:
        ref = inc["referenced_bytes"]
        lines.append(
            f"incremental: {inc['saves']} saves wrote {human_bytes(inc['bytes'] - ref)} of {human_bytes(inc['bytes'])} "
            f"({100 * ref / inc['bytes']:.0f}% referenced, not written again)"
        )
    for name, tier in summary.get("drains", {}).items():
        referenced = tier.get("referenced_bytes")
        if tier["file_bytes"]:
            lines.append(
                f"tier {name}: {tier['drains']} drains stored {human_bytes(tier['file_bytes'])} for "
                f"{human_bytes(tier['bytes'])} of checkpoint ({tier['bytes'] / tier['file_bytes']:.2f}x)"
                + (f"; {human_bytes(referenced)} referenced, not copied again" if referenced else "")
            )
        elif referenced:
            lines.append(f"tier {name}: {tier['drains']} drains copied nothing; {human_bytes(referenced)} referenced")
    return "".join(f"\n{line}" for line in lines)


def _stats(args: argparse.Namespace, out: Output) -> int:
    from ..errors import ObjectNotFoundError
    from ..events import EVENTS_NAME, read_events

    root = Path(args.root)
    if not root.is_dir():
        raise ObjectNotFoundError(f"checkpoint root {str(root)!r} does not exist", tier=str(root))
    events = read_events(root / EVENTS_NAME)
    shown = events[-args.last :] if args.last else events
    rows = [
        [
            str(e.get("step", "?")),
            str(e.get("outcome", "?")),
            _ms(e.get("blocked_s")),
            _ms(e.get("stage_s")),
            _ms(e.get("write_s")),
            _ms(e.get("commit_s")),
            _ms(e.get("total_s")),
            human_bytes(e["stored_bytes"]) if "stored_bytes" in e else "-",
            f"{e['write_gbps']:.2f}" if "write_gbps" in e else "-",
        ]
        for e in shown
    ]
    summary = summarize(events)
    text = (
        table(["step", "outcome", "blocked ms", "stage ms", "write ms", "commit ms", "total ms", "size", "GB/s"], rows)
        if rows
        else f"no saves recorded in {root / EVENTS_NAME}"
    )
    if summary.get("committed"):
        text += (
            f"\n\n{summary['committed']} committed, {summary['failed']} failed, {summary['skipped']} skipped; "
            f"blocked mean {_ms(summary['blocked_s_mean'])} ms, p50 {_ms(summary['blocked_s_p50'])} ms, "
            f"max {_ms(summary['blocked_s_max'])} ms"
        )
    text += _savings(summary)
    for e in shown:
        if e.get("outcome") == "failed":
            text += f"\nstep {e.get('step')} failed: {e.get('error', '')}"
    if args.plot:
        plot_timeline(shown, args.plot)
        text += f"\nwrote {args.plot}"
    out.emit({"root": str(root), "summary": summary, "saves": shown}, text)
    return EXIT_OK


def split_runs(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The saves grouped by training run: a new run starts where the step goes back (a resume) or after a
    pause much longer than the run's usual interval between saves (another job on the same root)."""
    kinds = ("committed", "failed", "skipped")  # a save's own records; drains to later tiers are not saves
    saves = [e for e in events if isinstance(e.get("time"), (int, float)) and e.get("outcome") in kinds]
    runs: list[list[dict[str, Any]]] = []
    for e in saves:
        run = runs[-1] if runs else None
        if run:
            gaps = sorted(float(b["time"]) - float(a["time"]) for a, b in itertools.pairwise(run))
            usual = gaps[len(gaps) // 2] if gaps else 0.0
            gap = float(e["time"]) - float(run[-1]["time"])
            went_back = isinstance(e.get("step"), int) and e["step"] <= run[-1].get("step", -1)
            if went_back or gap < 0 or gap > max(600.0, 20 * usual):
                run = None
        if run is None:
            runs.append([e])
        else:
            run.append(e)
    return runs


def plot_timeline(events: list[dict[str, Any]], path: str) -> None:
    """How long training was blocked, per save: one panel per run, a bar per save on a log scale of
    milliseconds (blocked in orange, the whole save's duration, in the background, beside it)."""
    from ..errors import BackendUnavailableError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailableError("plots need matplotlib: pip install 'tiersave[bench]'") from None
    runs = split_runs(events) or [[]]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.8 * len(runs) + 0.6), squeeze=False)
    for number, (ax, run) in enumerate(zip(axes[:, 0], runs), start=1):
        xs = list(range(len(run)))
        blocked = [max(1e3 * float(e.get("blocked_s", 0.0)), 1e-3) for e in run]
        total = [max(1e3 * float(e.get("total_s", 0.0)), 1e-3) for e in run]
        colors = ["tab:red" if e.get("outcome") == "failed" else "tab:orange" for e in run]
        ax.bar([x - 0.2 for x in xs], blocked, width=0.4, color=colors, label="training blocked")
        ax.bar([x + 0.2 for x in xs], total, width=0.4, color="tab:blue", alpha=0.45, label="whole save")
        if len(run) <= 40:  # the number itself, readable even where the bar is a sliver
            for x, e, b in zip(xs, run, blocked):
                text = "skipped" if e.get("outcome") == "skipped" else f"{b:.3g}"
                ax.annotate(
                    text, (x - 0.2, b), ha="center", va="bottom", fontsize=7, textcoords="offset points", xytext=(0, 2)
                )
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(e.get("step", "?")) for e in run], fontsize=7, rotation=90 if len(run) > 30 else 0)
        ax.set_ylabel("milliseconds (log)")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(run[0]["time"]))) if run else "-"
        failed = sum(e.get("outcome") == "failed" for e in run)
        ax.set_title(
            f"run {number}: {len(run)} saves from {started}, blocked median "
            f"{sorted(blocked)[len(blocked) // 2] if run else 0:.3g} ms"
            + (f", {failed} failed (red)" if failed else ""),
            fontsize=9,
        )
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    axes[-1, 0].set_xlabel("step (one save per bar pair)")
    fig.suptitle("tiersave saves: how long training was blocked per save, and the whole save beside it")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
