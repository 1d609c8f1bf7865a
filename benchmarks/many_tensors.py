"""Issue 15's benchmark: what a save and a restore cost per tensor, for states of very many tensors.

Measured side by side in one run, on the same state and the same disk, interleaved run by run:

- ``save``: tiersave ``save(blocking=True)`` (staged, written, fsync'd and committed; warm staging arena);
- ``async``: how long ``save_async`` blocks the caller (the handle is then waited for, outside the timing);
- ``restore``: a fresh ``Checkpointer`` on the same root, ``restore()`` into a new tree (manifest parsed,
  every chunk verified);
- ``torch.save``: ``torch.save`` of the same dict, then ``fsync`` of the file;
- ``torch.load``: ``torch.load(weights_only=True)`` of that file.

States: a flat dict of N tensors of 1 KiB each (``--counts``), and an MoE-like state of many expert
tensors of a few MiB (``--moe-mb`` in all, ``--expert-mib`` each) against the same bytes held in four
large tensors. Medians of ``--runs`` interleaved runs; ratios are what to compare across machines.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/many_tensors.py --counts 2000 20000 100000 --moe-mb 1024
    PYTHONPATH=src .venv/bin/python benchmarks/many_tensors.py --counts 20000 --profile save

``--nested`` replaces the flat dicts by a model's dict and its Adam state dict (a weight, ``step``, ``exp_avg``,
``exp_avg_sq`` per parameter: about ``--counts`` tensors in all, counted as saved).
``--restore-only`` measures only restores, into a new tree and into a live state (in place), wall and the process's
CPU time (its threads' included: the steadier figure on a loaded machine); with
``--moe-mb`` it compares the MoE-like state with the same bytes in a few tensors, as the MoE restore target
asks. ``--async-only`` measures only the ``save_async`` stall and its split (layout: flatten or the check against
the previous save's layout, and the plan / copies / the rest), next to the same save with its layout made afresh
(``TIERSAVE_REUSE_LAYOUT=0``), interleaved run by run. ``--profile save|async|restore|restore-into``
runs cProfile on one extra operation of the largest count and prints the functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import tiersave
from tiersave.state import flatten


def small_state(count: int, nbytes: int = 1024) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(count)
    return {f"experts.{i // 384}.{i % 384}.w": torch.randn(nbytes // 4, generator=g) for i in range(count)}


def nested_state(count: int, nbytes: int = 1024) -> dict[str, Any]:
    """About ``count`` tensors as a model and its Adam state hold them: per parameter of ``nbytes``, the weight
    in the model's dict and, in the optimizer's state dict, ``step`` (0-d), ``exp_avg`` and ``exp_avg_sq``;
    plus the optimizer's parameter groups and a few plain values."""
    g = torch.Generator().manual_seed(count)
    params = [torch.nn.Parameter(torch.randn(nbytes // 4, generator=g)) for _ in range(max(1, count // 4))]
    optim = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn(nbytes // 4, generator=g)
    optim.step()
    model = {f"layers.{i // 128}.experts.{i % 128}.w": p.detach() for i, p in enumerate(params)}
    return {"model": model, "optim": optim.state_dict(), "step": 1, "rng": {"seed": count}}


def moe_state(total_mb: int, expert_mib: int) -> dict[str, torch.Tensor]:
    per = expert_mib << 18  # float32 elements in expert_mib MiB
    count = max(1, (total_mb << 20) // (expert_mib << 20))
    g = torch.Generator().manual_seed(1)
    return {f"layers.{i // 64}.experts.{i % 64}.w": torch.randn(per, generator=g) for i in range(count)}


def few_state(total_mb: int, pieces: int = 4) -> dict[str, torch.Tensor]:
    per = (total_mb << 18) // pieces
    g = torch.Generator().manual_seed(2)
    return {f"big.{i}": torch.randn(per, generator=g) for i in range(pieces)}


class Case:
    """One state measured with every method; each method keeps its own samples."""

    def __init__(self, label: str, state: dict[str, Any], root: str) -> None:
        self.label = label
        self.state = state
        self.count = len(flatten(state).tensors)  # tensors saved (a nested state has more than keys)
        self.root = root
        self.samples: dict[str, list[float]] = {}
        self.ckpt_dir = os.path.join(root, label, "tiersave")
        self.torch_file = os.path.join(root, label, "state.pt")
        os.makedirs(self.ckpt_dir, exist_ok=True)
        self.ck = tiersave.Checkpointer(self.ckpt_dir, keep_last=2, event_log=False, handle_sigterm=False)
        self.step = 0
        self.live: dict[str, torch.Tensor] | None = None  # the live state of "restore.into", made once
        self.ck.save(self.step, self.state)  # warm: the staging arena exists from here on

    def record(self, method: str, seconds: float) -> None:
        self.samples.setdefault(method, []).append(seconds)

    def run_once(self, async_only: bool = False, restore_only: bool = False) -> None:
        if restore_only:
            for method, into in (("restore", False), ("restore.into", True)):
                wall, cpu = self._restore(into=into)
                self.record(method, wall)
                self.record(f"{method}.cpu", cpu)
            return
        if not async_only:
            self.step += 1
            t0 = time.perf_counter()
            self.ck.save(self.step, self.state)
            self.record("save", time.perf_counter() - t0)

        self._async("async")
        if async_only:
            # the same save with every layout made afresh (TIERSAVE_REUSE_LAYOUT=0), interleaved run by run
            os.environ["TIERSAVE_REUSE_LAYOUT"] = "0"
            try:
                self._async("fresh")
            finally:
                del os.environ["TIERSAVE_REUSE_LAYOUT"]
            return

        self.record("restore", self._restore()[0])

        t0 = time.perf_counter()
        torch.save(self.state, self.torch_file)
        with open(self.torch_file, "rb") as f:
            os.fsync(f.fileno())
        self.record("torch.save", time.perf_counter() - t0)

        t0 = time.perf_counter()
        torch.load(self.torch_file, weights_only=True)
        self.record("torch.load", time.perf_counter() - t0)

    def _async(self, method: str) -> None:
        self.step += 1
        # a collection owed to garbage of earlier operations (another case's manifests) would land in whichever
        # save allocates next: start each from the same collector state, so each pays only its own
        gc.collect()
        c0, t0 = time.thread_time(), time.perf_counter()
        handle = self.ck.save_async(self.step, self.state)
        blocked = time.perf_counter() - t0
        self.record(method, blocked)
        # the caller's CPU time: what the stall would be with a core to itself (on a loaded machine the wall
        # time adds the waits for a core)
        self.record(f"{method}.cpu", time.thread_time() - c0)
        # Where the stall goes, from the save's own statistics: the layout (flattening the state, or checking
        # it against the previous save's layout; the plan), staging (the copies), and the rest (addresses,
        # opening the shards, the handle).
        st = handle.stats
        self.record(f"{method}.flatten", st.flatten_s)
        self.record(f"{method}.stage", st.stage_s)
        self.record(f"{method}.rest", max(0.0, blocked - st.flatten_s - st.stage_s))
        handle.result(timeout=600)

    def _restore(self, into: bool = False) -> tuple[float, float]:
        """One restore by a fresh ``Checkpointer``: (wall seconds, the process's CPU seconds, its threads' too)."""
        reader = tiersave.Checkpointer(self.ckpt_dir, event_log=False, handle_sigterm=False)
        if into and self.live is None:
            self.live = {k: torch.empty_like(v) for k, v in self.state.items()}
        try:
            gc.collect()  # each restore pays for its own garbage, not for the previous operation's
            c0, t0 = time.process_time(), time.perf_counter()
            reader.restore(self.step, into=self.live if into else None)
            return time.perf_counter() - t0, time.process_time() - c0
        finally:
            reader.close()

    def median(self, method: str) -> float:
        return statistics.median(self.samples[method])

    def close(self) -> None:
        self.ck.close()


def profile(case: Case, what: str, top: int) -> None:
    ops: dict[str, Callable[[], Any]] = {
        "save": lambda: case.ck.save(case.step + 1, case.state),
        "async": lambda: case.ck.save_async(case.step + 1, case.state),
        "restore": lambda: tiersave.Checkpointer(case.ckpt_dir, event_log=False, handle_sigterm=False).restore(
            case.step
        ),
        "restore-into": lambda: tiersave.Checkpointer(case.ckpt_dir, event_log=False, handle_sigterm=False).restore(
            case.step, into={k: torch.empty_like(v) for k, v in case.state.items()}
        ),
    }
    prof = cProfile.Profile()
    prof.enable()
    result = ops[what]()
    prof.disable()
    if what == "async":
        result.result(timeout=600)
    case.step += 1
    print(f"\n== cProfile of {what}, {case.label} (own time) ==")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def plot(cases: list[Case], path: str, note: str) -> None:
    """Time per tensor (medians) against the number of tensors, log-log: flat lines mean a constant cost
    per tensor; a rising one, a cost that grows with the state."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [c.count for c in cases]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method, label in [
        ("save", "save (blocking)"),
        ("async", "save_async blocked"),
        ("restore", "restore"),
        ("torch.save", "torch.save + fsync"),
        ("torch.load", "torch.load"),
    ]:
        per = [c.median(method) / c.count * 1e6 for c in cases]
        ax.plot(counts, per, marker="o", linestyle="--" if method.startswith("torch") else "-", label=label)
    ax.axhline(5, color="grey", linewidth=0.8, linestyle=":", label="5 us target (save_async)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensors of 1 KiB in the state")
    ax.set_ylabel("us per tensor (median)")
    ax.set_title(f"Time per tensor, benchmarks/many_tensors.py ({note})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_samples(path: str, cases: list[Case]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({c.label: {"tensors": c.count, **c.samples} for c in cases}, f, indent=1)


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f} ms" if seconds < 10 else f"{seconds:9.2f} s "


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", type=int, nargs="*", default=[2000, 20000, 100000], help="tensors of 1 KiB")
    p.add_argument(
        "--nested",
        action="store_true",
        help="states as a model and its Adam state hold them (model dict + optimizer state dict) instead of flat dicts",
    )
    p.add_argument("--moe-mb", type=int, default=1024, help="MoE-like state size in MiB (0: skip)")
    p.add_argument("--expert-mib", type=int, default=4, help="MiB per expert tensor")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write the samples to this file")
    p.add_argument("--plot", default=None, help="write a PNG of time per tensor against the count of 1 KiB tensors")
    p.add_argument("--profile", choices=["save", "async", "restore", "restore-into"], default=None)
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--async-only",
        action="store_true",
        help="measure only how long save_async blocks (and its split): quick runs to compare two versions",
    )
    p.add_argument(
        "--restore-only",
        action="store_true",
        help="measure only restore into a new tree and into a live state (restore.into, in place)",
    )
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    root = tempfile.mkdtemp(prefix="many-tensors-", dir=args.dir)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    try:
        if args.nested:
            cases: list[Case] = [Case(f"nested-{n}x1KiB", nested_state(n), root) for n in args.counts]
        else:
            cases = [Case(f"{n}x1KiB", small_state(n), root) for n in args.counts]
        if args.moe_mb:
            cases.append(Case(f"moe-{args.expert_mib}MiB", moe_state(args.moe_mb, args.expert_mib), root))
            cases.append(Case("few-large", few_state(args.moe_mb), root))
        for r in range(args.runs):
            for case in cases:
                case.run_once(args.async_only, args.restore_only)
            print(f"run {r + 1}/{args.runs} done", file=sys.stderr)
        if args.restore_only:
            print(f"load average {os.getloadavg()[0]:.1f} at the end; {os.cpu_count()} cpus", file=sys.stderr)
            for case in cases:
                n = case.count
                print(
                    f"{case.label}: restore {fmt(case.median('restore')).strip()}, into a live state "
                    f"{fmt(case.median('restore.into')).strip()} (runs: "
                    + ", ".join(
                        f"{a:.3f}/{b:.3f}" for a, b in zip(case.samples["restore"], case.samples["restore.into"])
                    )
                    + f"); per tensor: new tree {case.median('restore') / n * 1e6:.1f} us "
                    f"(CPU {case.median('restore.cpu') / n * 1e6:.1f}), live state "
                    f"{case.median('restore.into') / n * 1e6:.1f} us "
                    f"(CPU {case.median('restore.into.cpu') / n * 1e6:.1f})"
                )
            if args.json:
                write_samples(args.json, cases)
            by_label = {c.label: c for c in cases}
            if args.moe_mb:
                moe, few = by_label[f"moe-{args.expert_mib}MiB"], by_label["few-large"]
                print(
                    f"MoE-like vs few large: restore {moe.median('restore') / few.median('restore'):.2f}x, "
                    f"into a live state {moe.median('restore.into') / few.median('restore.into'):.2f}x"
                )
            for case in cases:
                case.close()
            return 0
        methods = ["save", "torch.save", "async", "restore", "torch.load"]
        if args.async_only:
            print(f"load average {os.getloadavg()[0]:.1f} at the end; {os.cpu_count()} cpus", file=sys.stderr)
            for case in cases:
                n = case.count
                for method, what in (("async", "layout reused"), ("fresh", "laid out afresh")):
                    split = " / ".join(
                        f"{case.median(f'{method}.{k}') / n * 1e6:.2f}" for k in ("flatten", "stage", "rest")
                    )
                    print(
                        f"{case.label}, {what}: save_async blocked {fmt(case.median(method)).strip()} = "
                        f"{case.median(method) / n * 1e6:.2f} us per tensor (layout / copies / rest: {split}; "
                        f"runs {', '.join(f'{x / n * 1e6:.2f}' for x in case.samples[method])}); "
                        f"caller's CPU {case.median(f'{method}.cpu') / n * 1e6:.2f} us per tensor"
                    )
            for case in cases:
                case.close()
            return 0
        print(f"\nmedians of {args.runs} interleaved runs; torch {torch.__version__}; {os.cpu_count()} cpus")
        header = f"{'state':>14} | " + " | ".join(f"{m:>12}" for m in methods)
        header += " | save/torch | restore/load | async us/tensor"
        print(header)
        print("-" * len(header))
        for case in cases:
            med = {m: case.median(m) for m in methods}
            n = case.count
            print(
                f"{case.label:>14} | "
                + " | ".join(f"{fmt(med[m]):>12}" for m in methods)
                + f" | {med['save'] / med['torch.save']:10.2f} | {med['restore'] / med['torch.load']:12.2f}"
                + f" | {med['async'] / n * 1e6:15.2f}"
            )
        small = [c for c in cases if c.label.endswith("x1KiB")]
        if small:
            print(
                "\nper tensor (us): "
                + ", ".join(
                    f"{c.count}: save {c.median('save') / c.count * 1e6:.1f} / "
                    f"async {c.median('async') / c.count * 1e6:.1f} / "
                    f"restore {c.median('restore') / c.count * 1e6:.1f}"
                    for c in small
                )
            )
            print(
                "save_async stall per tensor (us; flatten / layout+plan+addresses / copies): "
                + ", ".join(
                    f"{c.count}: "
                    + " / ".join(f"{c.median(f'async.{k}') / c.count * 1e6:.1f}" for k in ("flatten", "rest", "stage"))
                    for c in small
                )
            )
        if args.plot and small:
            plot(small, args.plot, f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
        by = {c.label: c for c in cases}
        if args.moe_mb:
            moe, few = by[f"moe-{args.expert_mib}MiB"], by["few-large"]
            print(
                f"MoE-like vs few large: save {moe.median('save') / few.median('save'):.2f}x, "
                f"async {moe.median('async') / few.median('async'):.2f}x, "
                f"restore {moe.median('restore') / few.median('restore'):.2f}x"
            )
        if args.json:
            write_samples(args.json, cases)
        if args.profile:
            profile(cases[len(small) - 1] if small else cases[0], args.profile, args.top)
        for case in cases:
            case.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
