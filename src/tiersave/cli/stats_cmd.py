"""``tiersave stats``: the timings of past saves (time blocked, staging, writing, commit, throughput)."""

from __future__ import annotations

import argparse
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
        "--plot draws a timeline PNG.",
    )
    p.add_argument("root")
    p.add_argument("--last", type=int, default=50, help="show the last N saves (default 50; 0 = all)")
    p.add_argument("--plot", metavar="FILE", help="write a PNG timeline of the saves")
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
    return out


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
    for e in shown:
        if e.get("outcome") == "failed":
            text += f"\nstep {e.get('step')} failed: {e.get('error', '')}"
    if args.plot:
        plot_timeline(shown, args.plot)
        text += f"\nwrote {args.plot}"
    out.emit({"root": str(root), "summary": summary, "saves": shown}, text)
    return EXIT_OK


def plot_timeline(events: list[dict[str, Any]], path: str) -> None:
    """One row per save on a wall-clock axis: blocked (training waits) then background (write, commit)."""
    from ..errors import BackendUnavailableError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailableError("plots need matplotlib: pip install 'tiersave[bench]'") from None
    saves = [e for e in events if "time" in e]
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.3 * len(saves) + 1)))
    t0 = min((float(e["time"]) for e in saves), default=0.0)
    for row, e in enumerate(saves):
        start = float(e["time"]) - t0
        blocked = float(e.get("blocked_s", 0.0))
        total = float(e.get("total_s", blocked))
        color = {"committed": "tab:green", "failed": "tab:red", "skipped": "tab:gray"}.get(str(e.get("outcome")), "k")
        ax.broken_barh([(start, max(blocked, 1e-4))], (row - 0.35, 0.7), color="tab:orange")
        ax.broken_barh([(start + blocked, max(total - blocked, 0.0))], (row - 0.35, 0.7), color=color, alpha=0.6)
    ax.set_yticks(range(len(saves)), [str(e.get("step")) for e in saves])
    ax.set_xlabel("seconds since the first save shown")
    ax.set_ylabel("step")
    ax.set_title("tiersave saves: orange = training blocked, green = background write + commit, red = failed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
