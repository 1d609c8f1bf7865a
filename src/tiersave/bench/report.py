"""Turn a benchmark run's measurements into throughputs, ratios, target checks, a table and a plot.

Torch-free: everything here works from the run's JSON document (``BenchResult.to_json()`` or a file
written by ``tiersave bench --json``), so a stored reference run can be re-rendered anywhere. The text
report is the CLI's (``tiersave.cli.bench_cmd``).

Throughput is the state's tensor bytes over the *median* seconds of the rounds (every method moves the same
bytes, so ratios of throughput are inverse ratios of time), with the range over the rounds beside it (slowest
and fastest round). The raw device figure of a round is the best of its configurations, one stream and
several (see :mod:`tiersave.bench.device`); the report names the one that won.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from ..errors import BackendUnavailableError

__all__ = ["TARGETS", "plot", "ratio", "summarize"]

# (key, description, threshold): the targets, checked in every run.
TARGETS: tuple[tuple[str, str, float], ...] = (
    ("save_vs_raw_write", "save (until durable) vs raw direct-I/O write", 0.9),
    ("save_vs_torch", "save vs torch.save+fsync", 1.5),
    ("save_vs_dcp", "save vs DCP save", 1.5),
    ("restore_into_vs_raw_read", "restore into live state, cold, vs best raw read", 0.9),
    ("restore_new_vs_raw_read", "restore into new tensors, cold, vs best raw read", 0.9),
    ("restore_new_vs_torch", "restore (new tensors) vs torch.load", 1.5),
    ("restore_into_vs_dcp", "restore (into live state) vs DCP load", 1.5),
    ("save_vs_safetensors", "save vs safetensors+fsync", 1.5),
    ("save_vs_dcp_async", "save_async vs DCP async_save, until durable", 1.5),
    ("restore_new_vs_safetensors", "restore (new tensors) vs safetensors", 1.5),
    ("buffered_save_vs_plain_write", "io=buffered save vs a plain buffered write + fsync", 1.0),
    ("async_stall_vs_dlrover", "save_async stall vs DLRover-like copy into shared memory (shorter = higher)", 1.0),
    ("auto_vs_best_save", "auto policy vs better of direct/buffered: save", 0.95),
    ("auto_vs_best_load_new", "auto policy vs better of direct/buffered: restore new", 0.95),
    ("auto_vs_best_load_into", "auto policy vs better of direct/buffered: restore into", 0.95),
)


def _gbps(nbytes: int, seconds: list[float]) -> float | None:
    if not seconds:
        return None
    mid = median(seconds)
    return nbytes / mid / 1e9 if mid > 0 else None


def _gbps_range(nbytes: int, seconds: list[float]) -> list[float] | None:
    """The slowest and the fastest round's throughput."""
    if not seconds or min(seconds) <= 0:
        return None
    return [nbytes / max(seconds) / 1e9, nbytes / min(seconds) / 1e9]


def _rate_from_rates(nbytes: int, rates: list[float]) -> float | None:
    rates = [r for r in rates if r > 0]
    return _gbps(nbytes, [nbytes / (r * 1e9) for r in rates]) if rates else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing (or ``b`` is zero)."""
    return a / b if a is not None and b else None


def _distinct(labels: list[str]) -> str:
    return " / ".join(dict.fromkeys(labels))


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Throughput per method, raw limits, ratios and target checks of a run's JSON document."""
    nbytes = int(data["state"]["bytes"])
    raws = data.get("raw") or []
    raw: dict[str, Any] = {}
    if raws:
        best_w = [max(r["write_gbps"].values(), default=0.0) for r in raws]
        best_r = [max(r["read_gbps"].values(), default=0.0) for r in raws]
        raw = {
            "write_gbps": _rate_from_rates(nbytes, best_w),
            "read_gbps": _rate_from_rates(nbytes, best_r),
            # the configuration that was best in each round (the figure above takes each round's best)
            "write_config": _distinct([max(r["write_gbps"], key=r["write_gbps"].get) for r in raws]),
            "read_config": _distinct([max(r["read_gbps"], key=r["read_gbps"].get) for r in raws]),
            "configs": {
                "write": {
                    k: _rate_from_rates(nbytes, [r["write_gbps"].get(k, 0.0) for r in raws])
                    for k in raws[0]["write_gbps"]
                },
                "read": {
                    k: _rate_from_rates(nbytes, [r["read_gbps"].get(k, 0.0) for r in raws])
                    for k in raws[0]["read_gbps"]
                },
            },
        }
    methods: dict[str, Any] = {}
    for name, m in data["methods"].items():
        methods[name] = {
            "family": m["family"],
            "save_gbps": _gbps(nbytes, m["save_s"]),
            "save_range_gbps": _gbps_range(nbytes, m["save_s"]),
            "blocked_s": median(m["blocked_s"]) if m["blocked_s"] else None,
            "blocked_range_s": [min(m["blocked_s"]), max(m["blocked_s"])] if m["blocked_s"] else None,
            "load_gbps": {v: _gbps(nbytes, s) for v, s in m["load_s"].items()},
            "load_range_gbps": {v: _gbps_range(nbytes, s) for v, s in m["load_s"].items()},
        }
    main = (
        "tiersave-auto"
        if "tiersave-auto" in methods
        else next((n for n, m in methods.items() if m["family"] == "tiersave"), None)
    )

    def save(name: str | None) -> float | None:
        return methods[name]["save_gbps"] if name in methods else None

    def load(name: str | None, variant: str) -> float | None:
        return methods[name]["load_gbps"].get(variant) if name in methods else None

    def blocked(name: str) -> float | None:
        return methods[name]["blocked_s"] if name in methods else None

    ratios: dict[str, float | None] = {
        "save_vs_raw_write": ratio(save(main), raw.get("write_gbps")),
        "save_vs_torch": ratio(save(main), save("torch")),
        "save_vs_safetensors": ratio(save(main), save("safetensors")),
        "save_vs_dcp": ratio(save(main), save("dcp")),
        # both asynchronous saves, timed in the same phase of the run
        "save_vs_dcp_async": ratio(save("tiersave-async" if "tiersave-async" in methods else main), save("dcp-async")),
        "restore_into_vs_raw_read": ratio(load(main, "into"), raw.get("read_gbps")),
        "restore_new_vs_raw_read": ratio(load(main, "new"), raw.get("read_gbps")),
        "restore_new_vs_torch": ratio(load(main, "new"), load("torch", "new")),
        "restore_new_vs_safetensors": ratio(load(main, "new"), load("safetensors", "new")),
        "restore_into_vs_dcp": ratio(load(main, "into"), load("dcp", "into")),
        "buffered_save_vs_plain_write": ratio(save("tiersave-buffered"), save("plain-write")),
        # stalls: the reference's time over tiersave's, so that higher is better like every other ratio
        "async_stall_vs_dlrover": ratio(blocked("dlrover-shm"), blocked("tiersave-async")),
        "async_stall_vs_memcpy": ratio(blocked("memcpy"), blocked("tiersave-async")),
    }
    if main == "tiersave-auto":
        for key, case in (
            ("auto_vs_best_save", ""),
            ("auto_vs_best_load_new", "new"),
            ("auto_vs_best_load_into", "into"),
        ):

            def get(name: str, case: str = case) -> float | None:
                return save(name) if not case else load(name, case)

            others = [x for x in (get("tiersave-direct"), get("tiersave-buffered")) if x is not None]
            ratios[key] = ratio(get(main), max(others)) if others else None
    targets = []
    for key, what, threshold in TARGETS:
        value = ratios.get(key)
        if value is not None:
            targets.append({"key": key, "what": what, "target": threshold, "value": value, "met": value >= threshold})
    return {"bytes": nbytes, "main": main, "raw": raw, "methods": methods, "ratios": ratios, "targets": targets}


def plot(data: dict[str, Any], path: str) -> None:
    """Write a PNG: save and load throughput per method, with the raw device limits as lines.

    Raises:
        BackendUnavailableError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendUnavailableError("plotting needs matplotlib: pip install 'tiersave[bench]'") from None
    s = data.get("summary") or summarize(data)
    names = list(s["methods"])
    series = [
        ("save (until durable)", [s["methods"][n]["save_gbps"] for n in names]),
        ("load, new tensors", [s["methods"][n]["load_gbps"].get("new") for n in names]),
        ("load, into live state", [s["methods"][n]["load_gbps"].get("into") for n in names]),
    ]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(names) * len(series) / 2 + 2.5))
    height = 0.8 / len(series)
    for k, (label, values) in enumerate(series):
        ys = [i + k * height for i in range(len(names))]
        ax.barh(ys, [v or 0.0 for v in values], height=height, label=label)
    raw = s["raw"]
    if raw.get("write_gbps"):
        ax.axvline(raw["write_gbps"], color="black", linestyle="--", linewidth=1, label="raw direct write")
    if raw.get("read_gbps"):
        ax.axvline(raw["read_gbps"], color="gray", linestyle=":", linewidth=1.5, label="best raw read")
    ax.set_yticks([i + height for i in range(len(names))])
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (state bytes / seconds, cold cache for loads)")
    st = data["state"]
    ax.set_title(
        f"tiersave bench: {st['bytes'] / 1e9:.2f} GB {st['preset']}-like state, {data['machine']['filesystem']}"
    )
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
