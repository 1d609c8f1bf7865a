#!/usr/bin/env python3
"""Print the key figures of stored `tiersave bench` runs as Markdown tables (for docs/benchmarks.md).

Usage: .venv/bin/python benchmarks/summarize_runs.py [benchmarks/results/*.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tiersave.bench.report import TARGETS, summarize


def fmt(x: float | None, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{suffix}"


def main(argv: list[str]) -> int:
    paths = [Path(p) for p in argv] or sorted(Path(__file__).parent.joinpath("results").glob("*.json"))
    runs: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        data = json.loads(path.read_text())
        data["summary"] = summarize(data)  # recomputed: the arithmetic of this checkout
        runs.append((path.stem, data))
    print(
        "| run | load avg (1 min) start -> end | raw write | raw read (best) | "
        + " | ".join(m for m in runs[0][1]["summary"]["methods"])
        + " |"
    )
    print("|" + " --- |" * (4 + len(runs[0][1]["summary"]["methods"])))
    for name, data in runs:
        s, mach = data["summary"], data["machine"]
        cells = []
        for m in s["methods"].values():
            loads = "/".join(fmt(m["load_gbps"].get(v)) for v in ("new", "into") if v in m["load_gbps"])
            cells.append(f"{fmt(m['save_gbps'])} ; {loads or '-'}")
        print(
            f"| {name} | {mach['loadavg_start'][0]} -> {mach['loadavg_end'][0]} | {fmt(s['raw']['write_gbps'])} | "
            f"{fmt(s['raw']['read_gbps'])} | " + " | ".join(cells) + " |"
        )
    print()
    print("| target | threshold | " + " | ".join(name for name, _ in runs) + " |")
    print("| --- | --- |" + " --- |" * len(runs))
    for key, what, threshold in TARGETS:
        row = []
        for _, data in runs:
            value = data["summary"]["ratios"].get(key)
            row.append("-" if value is None else f"{value:.2f}x {'met' if value >= threshold else '**missed**'}")
        print(f"| {what} | >= {threshold}x | " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
