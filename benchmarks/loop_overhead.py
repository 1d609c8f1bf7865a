"""Issue 16's training-loop overhead, in the issue's setting: an accelerator job checkpointing every 8 steps.

What one step is here: the host thread sleeps ``--step-s`` seconds (about 0.5 s), which is what a training
process's CPU thread does while the accelerator runs forward and backward (it waits in
``torch.cuda.synchronize()`` or on the next blocking copy), then the "optimizer step" writes every tensor of
the state in place. With ``--write touch`` (the default) it adds 1 to three elements of each tensor (first,
middle, last): the host's share of a device optimizer step is a few kernel launches, yet every tensor really
changes, so a lazy save's guard must hold the step back until that tensor is staged, and a save that let a
later step's bytes in would fail the check below. ``--write full`` adds 1 to every element, on this CPU: a
memory-bound pass a device step would not put on the host (use it to see that contention, not the issue's
figure).

A checkpoint is taken after step ``every // 2`` and then every ``every`` steps (8: after 4, 12, 20, 28 of 32),
so the loop holds ``steps / every`` checkpoints and each is followed by steps that change the state. Methods,
interleaved in every repetition with the order rotated: no checkpoint; tiersave ``save_async`` (eager: returns
once the state is copied into its staging arena); tiersave lazy (``save_async(..., lazy=True)`` with the
optimizer guarded, so ``optimizer.step()`` waits only until its tensors are staged); DCP ``async_save``; and
``torch.save`` in a thread (the state copied into preallocated buffers on the caller, then ``torch.save`` +
fsync on a thread). Every method's setup (staging arena, buffers, calibration) is done before the timed loop.

Per method: the loop's wall time for ``steps`` steps and its overhead over the checkpoint-free loop (medians of
the repetitions), the summed time the training thread was blocked (the save calls, plus the lazy guard's waits
in ``step()``, plus waits for a previous save a method cannot queue), and the tail: how long after the last
step the last checkpoint took to become durable. After each run the last checkpoint is read back and
compared with the live state: it must hold the values of the step it was saved at (``verified``).

What it does not measure: the CPU contention of a CPU-only trainer. Here the forward and backward are a
sleep, so the host's cores are free for the checkpoint's background copy, checksum and writes, as on an
accelerator host; on a CPU-only trainer those compete with the training's own compute
(benchmarks/async_save.py's MLP loop). Nor the device-to-host copy of a real accelerator: the state is in host
memory, so "staging" is a host memcpy.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/loop_overhead.py --state-mb 1024 3072 --steps 32 --reps 3 \\
        --dir /path/on/the/disk --json benchmarks/results/loop_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import tiersave
from tiersave.bench.workload import build_state, gpt_like_spec

sys.path.insert(0, str(Path(__file__).parent))
from async_save import fsync_dir_tree

METHODS = ("no checkpoint", "tiersave save_async", "tiersave lazy", "DCP async_save", "torch.save thread")
TARGET = 0.10  # issue 16: loop overhead <= +10%
BLOCKED = ("blocked_s", "blocked_previous_s", "blocked_call_s", "blocked_hook_s")
VERIFY_GROUP_BYTES = 256 << 20  # the read-back check holds at most this much of a checkpoint at once


class DeviceStep(torch.optim.Optimizer):
    """The optimizer step of an accelerator job, as the host sees it: every tensor of the state written in place.

    It holds every tensor of the state as a parameter, so a tiersave guard covers all of them.
    """

    def __init__(self, state: dict[str, torch.Tensor], write: str) -> None:
        super().__init__(list(state.values()), {})
        self.tensors = list(state.values())
        self.write = write
        self.points = [torch.tensor(sorted({0, t.numel() // 2, t.numel() - 1})) for t in self.tensors]
        self.ones = [torch.ones(len(p)) for p in self.points]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if self.write == "full":
            torch._foreach_add_(self.tensors, 1.0)
            return
        for t, idx, ones in zip(self.tensors, self.points, self.ones):
            t.view(-1).index_add_(0, idx, ones)


class Method:
    """One checkpointing method over one run: ``save`` returns the seconds the caller was blocked."""

    name = "no checkpoint"

    def __init__(self, root: Path, state: dict[str, torch.Tensor], optim: DeviceStep) -> None:
        self.root = root
        self.state = state
        self.optim = optim
        self.previous_s = 0.0  # blocked waiting for the previous save (a method that cannot queue saves)
        self.call_s = 0.0  # blocked in the save call itself (the copy, for an eager method)
        self.not_lazy = 0  # lazy saves staged whole before returning: the state did not fit the staging budget

    def save(self, step: int) -> float:
        """Wait for the previous save where the method needs it, then save; returns the seconds both took."""
        t0 = time.perf_counter()
        self.wait_previous()
        t1 = time.perf_counter()
        self.start(step)
        t2 = time.perf_counter()
        self.previous_s += t1 - t0
        self.call_s += t2 - t1
        return t2 - t0

    def wait_previous(self) -> None:
        """What the next save waits for before it can start."""

    def start(self, step: int) -> None:
        """Start the save of ``step``."""

    def hook_s(self) -> float:
        """Blocked in the optimizer's step(), waiting for a lazy save's staging."""
        return 0.0

    def finish(self) -> None:
        """Wait until the last checkpoint is durable."""

    def read(self, step: int, names: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the method holds (its staging memory, threads)."""


class TiersaveEager(Method):
    name = "tiersave save_async"
    lazy = False

    def __init__(self, root: Path, state: dict[str, torch.Tensor], optim: DeviceStep) -> None:
        super().__init__(root, state, optim)
        guard = optim if self.lazy else None
        self.ckpt = tiersave.Checkpointer(root, keep_last=2, guard=guard, handle_sigterm=False)
        self.ckpt.prepare(state)  # the staging arena and the I/O calibration, before the timed loop
        self.guard = self.ckpt.guard() if self.lazy else None
        self.waited_before = self.guard.waited_s if self.guard is not None else 0.0
        self.handle: Any = None

    def wait_previous(self) -> None:
        if self.handle is not None:  # what save_async itself would wait for (on_busy="wait"), timed apart
            self.handle.wait()

    def start(self, step: int) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", tiersave.TiersaveWarning)
            self.handle = self.ckpt.save_async(step, self.state, lazy=self.lazy)
        for w in caught:  # tiersave warns once per guard; the first one is what a run needs to know
            if "does not fit its staging memory" in str(w.message):
                self.not_lazy += 1
            print(f"  {self.name}: {w.message}")

    def hook_s(self) -> float:
        return self.guard.waited_s - self.waited_before if self.guard is not None else 0.0

    def finish(self) -> None:
        self.ckpt.wait()

    def read(self, step: int, names: list[str]) -> dict[str, torch.Tensor]:
        into = {n: torch.empty_like(self.state[n]) for n in names}
        self.ckpt.restore(step, into=into)
        return into

    def close(self) -> None:
        self.ckpt.close()


class TiersaveLazy(TiersaveEager):
    name = "tiersave lazy"
    lazy = True


class DcpAsync(Method):
    name = "DCP async_save"

    def __init__(self, root: Path, state: dict[str, torch.Tensor], optim: DeviceStep) -> None:
        super().__init__(root, state, optim)
        self.future: Any = None
        self.dirs: list[Path] = []

    def wait_previous(self) -> None:
        if self.future is not None:  # DCP does not queue saves: the caller waits for the previous one
            self.future.result()

    def start(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        target = self.root / str(step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.future = dcp.async_save(self.state, checkpoint_id=str(target))
        self.dirs.append(target)
        while len(self.dirs) > 2:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None
        for d in self.dirs:  # DCP's writer does not fsync: a durable end is the fair end
            fsync_dir_tree(str(d))

    def read(self, step: int, names: list[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        into = {n: torch.empty_like(self.state[n]) for n in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(into, checkpoint_id=str(self.root / str(step)))
        return into


class TorchSaveThread(Method):
    """The simple asynchronous save: copy into preallocated buffers, then ``torch.save`` + fsync on a thread."""

    name = "torch.save thread"

    def __init__(self, root: Path, state: dict[str, torch.Tensor], optim: DeviceStep) -> None:
        super().__init__(root, state, optim)
        root.mkdir(parents=True, exist_ok=True)
        self.buffers = {n: t.clone() for n, t in state.items()}  # allocated and faulted in before the loop
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="torch-save")
        self.future: Future[None] | None = None

    def wait_previous(self) -> None:
        if self.future is not None:  # one set of buffers: the previous save must have read them
            self.future.result()

    def start(self, step: int) -> None:
        for n, t in self.state.items():
            self.buffers[n].copy_(t)
        self.future = self.pool.submit(self._write, step)

    def _write(self, step: int) -> None:
        path = self.root / f"{step}.pt"
        with open(path, "wb") as f:
            torch.save(self.buffers, f)
            f.flush()
            os.fsync(f.fileno())
        for old in sorted(self.root.glob("*.pt"), key=lambda p: int(p.stem))[:-2]:
            old.unlink()

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()

    def read(self, step: int, names: list[str]) -> dict[str, torch.Tensor]:
        loaded = torch.load(self.root / f"{step}.pt", mmap=True, weights_only=True)
        return {n: loaded[n] for n in names}

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.buffers.clear()


CLASSES: dict[str, type[Method]] = {c.name: c for c in (Method, TiersaveEager, TiersaveLazy, DcpAsync, TorchSaveThread)}


def verify(method: Method, step: int, final: int, optim: DeviceStep) -> bool:
    """The checkpoint of ``step`` holds the state as it was after ``step``: the live state minus the
    ``final - step`` later steps' writes (compared a group of tensors at a time)."""
    later = float(final - step)
    names = list(method.state)
    points = dict(zip(names, optim.points))
    groups: list[list[str]] = [[]]
    size = 0
    for n in names:
        if size > VERIFY_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += method.state[n].nbytes
    for group in groups:
        saved = method.read(step, group)
        for n in group:
            expect = method.state[n].clone()
            if optim.write == "full":
                expect -= later
            else:
                expect.view(-1)[points[n]] -= later
            if not torch.allclose(saved[n].float(), expect, rtol=0.0, atol=1e-3):
                print(f"  {method.name}: tensor {n} of step {step} differs from the state after step {step}")
                return False
    return True


def run_once(
    name: str, root: Path, state: dict[str, torch.Tensor], optim: DeviceStep, steps: int, every: int, step_s: float
) -> dict[str, Any]:
    """One timed loop of ``steps`` steps with ``name``'s checkpoints; then its read-back check."""
    method = CLASSES[name](root, state, optim)
    try:
        blocked = 0.0
        saves = 0
        last = 0
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            time.sleep(step_s)  # forward + backward on the accelerator: the host thread waits for it
            optim.step()
            if name != "no checkpoint" and s % every == every // 2:
                blocked += method.save(s)
                saves += 1
                last = s
        wall = time.perf_counter() - t0
        method.finish()
        tail = time.perf_counter() - t0 - wall
        hook = method.hook_s()
        ok = verify(method, last, steps, optim) if saves else True
    finally:
        method.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "wall_s": wall,
        "tail_s": tail,
        "blocked_s": blocked + hook,
        "blocked_previous_s": method.previous_s,
        "blocked_call_s": method.call_s,
        "blocked_hook_s": hook,
        "saves": saves,
        "verified": ok,
        "lazy_fell_back": method.not_lazy > 0,
    }


def measure(
    work: Path, state_bytes: int, steps: int, every: int, step_s: float, reps: int, write: str, methods: list[str]
) -> dict[str, Any]:
    """Every method ``reps`` times, interleaved, the order rotated each repetition; medians per method."""
    spec = gpt_like_spec(target_bytes=state_bytes)
    state = build_state(spec)
    optim = DeviceStep(state, write)
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for rep in range(reps):
        order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
        for k, name in enumerate(order):
            root = work / f"{rep}-{k}"
            r = run_once(name, root, state, optim, steps, every, step_s)
            r["load_1min"] = os.getloadavg()[0]
            runs[name].append(r)
            print(
                f"  rep {rep + 1} {name:22} wall {r['wall_s']:7.2f} s  blocked {r['blocked_s']:6.3f} s (previous "
                f"{r['blocked_previous_s']:.3f}, call {r['blocked_call_s']:.3f}, hook {r['blocked_hook_s']:.3f})  "
                f"tail {r['tail_s']:5.2f} s  verified {r['verified']}  load {r['load_1min']:.1f}",
                flush=True,
            )
    load_after = os.getloadavg()
    del optim, state
    med = {
        name: {
            "wall_s": statistics.median(r["wall_s"] for r in rs),
            "wall_range_s": [min(r["wall_s"] for r in rs), max(r["wall_s"] for r in rs)],
            **{k: statistics.median(r[k] for r in rs) for k in BLOCKED},
            "tail_s": statistics.median(r["tail_s"] for r in rs),
            "saves": rs[0]["saves"],
            "verified": all(r["verified"] for r in rs),
            "reps_not_lazy": sum(r["lazy_fell_back"] for r in rs),
            "reps": rs,
        }
        for name, rs in runs.items()
    }
    base = med["no checkpoint"]["wall_s"] if "no checkpoint" in med else steps * step_s
    for r in med.values():
        r["overhead"] = r["wall_s"] / base - 1
        r["overhead_until_durable"] = (r["wall_s"] + r["tail_s"]) / base - 1
    return {
        "state": spec.to_json(),
        "steps": steps,
        "every": every,
        "step_s": step_s,
        "write": write,
        "reps": reps,
        "load_1min": [load_before[0], load_after[0]],
        "methods": med,
        "target_met": {
            m: med[m]["overhead"] <= TARGET and med[m]["verified"]
            for m in ("tiersave save_async", "tiersave lazy")
            if m in med
        },
    }


def print_table(res: dict[str, Any], out: Callable[[str], None] = print) -> None:
    st = res["state"]
    out(
        f"\nstate {st['bytes'] / 2**30:.2f} GiB ({st['tensors']} tensors), {res['steps']} steps of {res['step_s']} s "
        f"(write: {res['write']}), a checkpoint every {res['every']}; medians of {res['reps']} interleaved reps; "
        f"load (1 min) {res['load_1min'][0]:.1f} -> {res['load_1min'][1]:.1f}"
    )
    out(
        "| method | loop wall s (range) | overhead | blocked s (sum) | of which: previous save / call / step() hook "
        "| tail to durable s | verified |"
    )
    out("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in res["methods"].items():
        lo, hi = r["wall_range_s"]
        out(
            f"| {name} | {r['wall_s']:.2f} ({lo:.2f}-{hi:.2f}) | {r['overhead'] * 100:+.1f}% | {r['blocked_s']:.3f} | "
            f"{r['blocked_previous_s']:.3f} / {r['blocked_call_s']:.3f} / {r['blocked_hook_s']:.3f} | "
            f"{r['tail_s']:.2f} | {'yes' if r['verified'] else '**no**'} |"
        )
    for name, r in res["methods"].items():
        if r["reps_not_lazy"]:
            out(f"{name}: in {r['reps_not_lazy']} rep(s) a save did not fit its staging budget and was staged whole")
    for m, met in res["target_met"].items():
        out(f"{m}: overhead <= +{TARGET * 100:.0f}% {'met' if met else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=int, nargs="+", default=[1024], help="state sizes, MiB (default 1024)")
    p.add_argument("--steps", type=int, default=32, help="steps per loop (default 32)")
    p.add_argument("--every", type=int, default=8, help="a checkpoint every this many steps (default 8)")
    p.add_argument(
        "--step-s",
        type=float,
        default=0.5,
        help="seconds the host waits per step for the accelerator's forward and backward, a sleep (default 0.5)",
    )
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions, at least 3 for a median (default 3)")
    p.add_argument(
        "--write",
        choices=("touch", "full"),
        default="touch",
        help="touch (default): +1 on 3 elements of each tensor, a device step as its host sees it; full: +1 on every "
        "element on this CPU, the contention of a CPU-only trainer (not the issue's setting)",
    )
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="methods to run")
    p.add_argument("--dir", default=None, help="work directory on the disk to test (default: a temp dir here)")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.add_argument("--allow-few-reps", action="store_true", help=argparse.SUPPRESS)  # the script's own test
    args = p.parse_args(argv)
    if args.reps < 3 and not args.allow_few_reps:
        p.error("--reps must be at least 3: the figures are medians")
    if args.steps < 1 or args.every < 1 or args.step_s < 0 or min(args.state_mb) < 1:
        p.error("--steps, --every and --state-mb must be positive and --step-s not negative")
    methods = [m for m in METHODS if m in args.methods]
    work = Path(tempfile.mkdtemp(prefix="tiersave-loop-", dir=args.dir or "."))
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "runs": [],
    }
    try:
        for mb in args.state_mb:
            res = measure(work, mb << 20, args.steps, args.every, args.step_s, args.reps, args.write, methods)
            report["runs"].append(res)
            print_table(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = all(m["verified"] for r in report["runs"] for m in r["methods"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
