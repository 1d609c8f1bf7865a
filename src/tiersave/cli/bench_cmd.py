"""``tiersave bench``: checkpoint save/restore throughput against the raw device and the peers.

Imports only the standard library at import time (``tiersave --help`` stays fast and torch-free); the
benchmark package, torch and matplotlib are imported by the handler.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ..errors import ConfigError
from ..units import parse_bytes, table
from ._common import EXIT_FAILURE, EXIT_OK, Output, add_json_flag, positive_int

_EPILOG = """\
examples:
  # the reference run of docs/benchmarks.md: a 3 GB Llama-3-8B-like state, 3 checkpoints per method
  tiersave bench /work/bench --model llama3-8b --size 3GB --checkpoints 3 --plot bench.png
  # tiersave alone (no peers), auto mode only, as JSON
  tiersave bench /scratch/b --size 1GB --io auto --peers none --json
  # one checkpoint saved by 4 ranks, next to DCP; --replicated: each rank holds the whole state (DDP)
  tiersave bench /scratch/b --size 3GB --io auto --peers dcp,dcp-async --no-raw --ranks 4 --replicated

Reads are cold: every file is fsync-ed and evicted with posix_fadvise(DONTNEED) before each timed
operation, and as root the page cache is dropped as well (--no-drop-caches to skip that).
"""

_PEERS = ("torch", "safetensors", "dcp", "dcp-async", "memcpy", "dlrover-shm", "plain-write")
_IO = ("auto", "direct", "buffered", "async")


def _list(choices: tuple[str, ...], what: str) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        if text.strip().lower() in ("none", ""):
            return ()
        items = tuple(x.strip().lower() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(choices)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"a {what} is listed twice")
        return items

    return parse


def register(subparsers: Any) -> None:
    """Add the ``bench`` subcommand to the ``tiersave`` parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="measure save/restore throughput against the raw device and torch.save, safetensors, DCP",
        description=(
            "Checkpoint storage benchmark (MLPerf Storage checkpointing style): a GPT-like state of fp32\n"
            "weights and Adam moments is saved until durable and restored from a cold cache, by tiersave in\n"
            "each I/O mode and by the peers, next to the device's raw direct-I/O limits measured in the\n"
            "same run on the same directory. Prints a table, the ratios, and the targets met or missed\n"
            "(the targets, the reference runs and how to read them: docs/benchmarks.md)."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", type=Path, help="where to write (on the file system to measure)")
    p.add_argument("--model", default="llama3-8b", metavar="PRESET", help="shape preset (default llama3-8b)")
    p.add_argument("--size", default="3GB", metavar="BYTES", help="state size: weights + Adam moments (default 3GB)")
    p.add_argument(
        "--checkpoints", type=positive_int, default=3, metavar="N", help="timed checkpoints per method (default 3)"
    )
    p.add_argument(
        "--warmup", type=int, default=1, metavar="N", help="untimed rounds before the timed ones (default 1)"
    )
    p.add_argument(
        "--io",
        type=_list(_IO, "io mode"),
        default=_IO,
        metavar="MODES",
        help="tiersave save modes, comma-separated: blocking saves per I/O policy, and async (save_async, auto "
        "policy) (default auto,direct,buffered,async)",
    )
    p.add_argument(
        "--peers",
        type=_list(_PEERS, "peer"),
        default=_PEERS,
        metavar="PEERS",
        help="peers and yardsticks, comma-separated, or none (default torch,safetensors,dcp,dcp-async and the "
        "yardsticks memcpy,dlrover-shm (copies into shared memory) and plain-write (a buffered write + fsync))",
    )
    p.add_argument(
        "--threads", type=positive_int, metavar="N", help="tiersave I/O threads (default TIERSAVE_IO_THREADS)"
    )
    p.add_argument(
        "--ranks",
        type=positive_int,
        default=0,
        metavar="N",
        help="also save one checkpoint from N processes (gloo), next to DCP's save, load and async_save",
    )
    p.add_argument(
        "--replicated", action="store_true", help="with --ranks: every rank holds the whole state, declared replicated"
    )
    p.add_argument("--no-raw", action="store_true", help="skip the raw device measurement")
    p.add_argument("--no-drop-caches", action="store_true", help="evict with fadvise only, never drop_caches")
    p.add_argument("--recalibrate", action="store_true", help="measure the auto policy's calibration again")
    p.add_argument("--seed", type=int, default=0, help="seed of the state's values (default 0)")
    p.add_argument(
        "--aligned-state",
        action="store_true",
        help="allocate every tensor at a page boundary, as a device whose direct I/O takes torch's memory sees it",
    )
    p.add_argument("--keep", action="store_true", help="leave the last checkpoints on disk")
    p.add_argument("--plot", metavar="FILE", help="write a PNG bar chart")
    p.add_argument("--output", metavar="FILE", help="also write the JSON document to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--check", action="store_true", help="exit with status 1 when a target is missed")
    add_json_flag(p)
    p.set_defaults(handler=_bench)


class _ProgressBar:
    """A one-line progress bar on stderr (redrawn in place on a terminal, one line per step otherwise)."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = stream.isatty()
        self.start = time.monotonic()

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = width * done // max(total, 1)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {time.monotonic() - self.start:5.0f}s {label}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line + ("\n" if done >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _bench(args: argparse.Namespace, out: Output) -> int:
    from ..bench import BenchConfig, run_bench
    from ..bench.report import plot

    size = parse_bytes(args.size)
    if not args.io and not args.peers:
        raise ConfigError("nothing to run: --io and --peers are both empty")
    config = BenchConfig(
        directory=args.directory.expanduser().resolve(),
        model=args.model,
        size_bytes=size,
        checkpoints=args.checkpoints,
        warmup=args.warmup,
        io_modes=args.io,
        peers=args.peers,
        io_threads=args.threads,
        raw=not args.no_raw,
        drop_caches=not args.no_drop_caches,
        recalibrate=args.recalibrate,
        ranks=args.ranks,
        replicated=args.replicated,
        seed=args.seed,
        aligned_state=args.aligned_state,
        keep=args.keep,
    )
    result = run_bench(config, progress=_ProgressBar(sys.stderr, not args.quiet))
    data = result.to_json()
    if args.output:
        Path(args.output).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if args.plot:
        plot(data, args.plot)
    out.emit(data, render_text(data))
    missed = [t for t in data["summary"]["targets"] if not t["met"]]
    return EXIT_FAILURE if args.check and missed else EXIT_OK


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _spread(x: float | None, span: list[float] | None, spec: str = ".2f") -> str:
    """A median and, when the rounds differ, their range: ``1.23 (1.10-1.30)``."""
    if x is None or not span or f"{span[0]:{spec}}" == f"{span[1]:{spec}}":
        return _fmt(x, spec)
    return f"{x:{spec}} ({span[0]:{spec}}-{span[1]:{spec}})"


def render_text(data: dict[str, Any]) -> str:
    """The run as a plain-text report: the setup, a table per method, the ratios and the targets."""
    from ..bench.report import ratio

    s = data["summary"]
    st, cfg, mach = data["state"], data["config"], data["machine"]
    lines = [
        f"tiersave bench: {st['preset']} scaled to {st['params'] / 1e6:.1f}M params + Adam moments, "
        f"{st['tensors']} fp32 tensors, {st['bytes'] / 1e9:.2f} GB; {cfg['checkpoints']} timed checkpoint(s) "
        f"per method after {cfg.get('warmup', 0)} warm-up round(s)"
        + ("; every tensor page-aligned (--aligned-state)" if cfg.get("aligned_state") else ""),
        f"directory {cfg['directory']} ({mach['filesystem']} on device {mach['device']}), {mach['cpus']} CPUs, "
        f"kernel {mach['kernel']}, load average {mach.get('loadavg_start')} -> {mach.get('loadavg_end')}; "
        f"cache eviction: {data['eviction']}"
        + (f"; staging copy: {mach['stage_copy']}" if "stage_copy" in mach else ""),
    ]
    raw = s["raw"]
    if raw:
        lines.append(
            f"raw device, same bytes, 16 MiB blocks, best configuration per round: write "
            f"{_fmt(raw['write_gbps'])} GB/s ({raw['write_config']}), read {_fmt(raw['read_gbps'])} GB/s "
            f"({raw['read_config']}); each configuration: "
            + ", ".join(f"{op} {k} {_fmt(v)}" for op in ("write", "read") for k, v in raw["configs"][op].items())
        )
    cal = data.get("calibration")
    if cal:
        lines.append(
            f"auto calibration ({cal['key']}): write direct {cal['direct_write_gbps']:.2f} / buffered "
            f"{cal['buffered_write_gbps']:.2f} GB/s, read direct {cal['direct_read_gbps']:.2f} / buffered "
            f"{cal['buffered_read_gbps']:.2f} GB/s"
        )
    rows = []
    raw_w, raw_r = raw.get("write_gbps"), raw.get("read_gbps")
    for name, m in s["methods"].items():
        new, into = m["load_gbps"].get("new"), m["load_gbps"].get("into")
        best_load = max((x for x in (new, into) if x is not None), default=None)
        spans = m.get("load_range_gbps") or {}
        rows.append(
            [
                name,
                _spread(m["save_gbps"], m.get("save_range_gbps")),
                _spread(m["blocked_s"], m.get("blocked_range_s"), ".3f"),
                _spread(new, spans.get("new")),
                _spread(into, spans.get("into")),
                _fmt(ratio(m["save_gbps"], raw_w), ".2f", "x"),
                _fmt(ratio(best_load, raw_r), ".2f", "x"),
            ]
        )
    lines += [
        "",
        table(
            ["method", "save GB/s", "blocked s", "load new GB/s", "load into GB/s", "save/raw", "load/raw"],
            rows,
        ),
        "medians over the rounds (slowest-fastest round); save: until durable, except the copy yardsticks "
        "(memcpy, dlrover-shm), which are a copy into shared memory",
    ]
    if data.get("ranks"):
        lines += _render_ranks(data["ranks"])
    lines += ["", f"ratios ({s['main']}):"]
    for key, value in s["ratios"].items():
        if value is not None:
            lines.append(f"  {key:28s} {value:.2f}x")
    if s["targets"]:
        lines += ["", "targets:"]
        for t in s["targets"]:
            lines.append(
                f"  [{'met' if t['met'] else 'MISSED'}] {t['what']}: {t['value']:.2f}x (target >= {t['target']}x)"
            )
    for note in data.get("notes") or []:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _render_ranks(ranks: dict[str, Any]) -> list[str]:
    """The multi-rank phase: per method, the median over rounds of the slowest rank, and the ratios."""
    layout = "the whole state on every rank, declared replicated" if ranks.get("replicated") else "a 1/N share each"
    lines = ["", f"{ranks['ranks']} rank(s), one checkpoint per save ({layout}); job figures set by the slowest rank:"]
    rows = []
    order = ["tiersave-save", "dcp-save", "tiersave-load", "dcp-load", "tiersave-async", "dcp-async", "memcpy"]
    slowest = ranks["summary"]["slowest_s"]
    for name in sorted(slowest, key=lambda m: order.index(m) if m in order else len(order)):
        seconds = slowest[name]
        per_round = [r["methods"][name] for r in ranks["rounds"]]
        rows.append(
            [
                name,
                _fmt(seconds, ".3f"),
                _fmt(statistics.median(m["bytes"] for m in per_round) / 1e9, ".2f"),
                _fmt(statistics.median(m["gbps"] for m in per_round)),
                _fmt(statistics.median(m["lowest_rank_gbps"] for m in per_round)),
            ]
        )
    lines.append(table(["method", "slowest rank s", "GB (all ranks)", "job GB/s", "lowest rank GB/s"], rows))
    s = ranks["summary"]
    keys = (
        "save_vs_dcp",
        "load_vs_dcp",
        "async_blocked_vs_memcpy",
        "async_job_blocked_vs_memcpy",
        "async_cpu_vs_memcpy",
    )
    lines += [f"  {key:28s} {s[key]:.2f}x" for key in keys if s.get(key) is not None]
    return lines
