"""Issue 4's benchmark: how long a save blocks training, and what checkpointing costs a training loop.

Measured side by side in one run, on the same state and the same disk:

1. **Stall.** One ``memcpy`` of the state into preallocated memory (the target's yardstick) against the
   time ``tiersave`` ``save_async`` blocks (warm: the staging arena already exists), ``torch.save`` + fsync
   (synchronous: blocks for all of it) and DCP ``async_save`` (blocks while it stages). The lazy snapshot
   (``save_async(..., lazy=True)`` with the optimizer guarded) is measured as the time the call blocks plus
   the time the optimizer's next ``step()`` then waits, with ``--window`` seconds of forward and backward
   between them (simulated by a sleep, as on a GPU host where the CPU is free meanwhile) and with none.
2. **Training overhead.** The same training loop with no checkpoints, and with a checkpoint every K steps
   through each method; the overhead is the extra wall time over the checkpoint-free loop. The lazy
   method's blocked time includes what its guarded ``optimizer.step()`` waited.
3. **Memory.** Peak resident memory of a process doing 20 tiersave saves against the state's size plus
   the staging budget, and resident-memory growth over those saves.

Usage::

    .venv/bin/python benchmarks/async_save.py --state-mb 1024 --json benchmarks/results/async_save.json

The training loop here runs on this CPU, so on a shared host it measures the CPU contention of a CPU-only
trainer and swings with the load; the loop overhead of issue 16's setting (an accelerator job, whose host
waits for the device each step) is benchmarks/loop_overhead.py's.

The state is a GPT-like dict of fp32 tensors (model + two Adam moments). Results go to stdout as a table
and, with --json, to a file. Ratios are what to compare across machines; absolute times drift.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch


def as_module_and_adam(state: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same tensors as a module's parameters and an Adam's moments (shared, not copied)."""
    module = torch.nn.Module()
    optim_state = {}
    for i, (name, w) in enumerate(state["model"].items()):
        p = torch.nn.Parameter(w, requires_grad=True)
        module.register_parameter(f"p{i}", p)
        optim_state[p] = {"step": torch.tensor(1.0), "exp_avg": state["optim"]["exp_avg"][name],
                          "exp_avg_sq": state["optim"]["exp_avg_sq"][name]}  # fmt: skip
    optim = torch.optim.Adam(module.parameters())
    optim.state.update(optim_state)
    return module, optim


def gpt_like_state(total_mb: int, n_tensors: int = 200) -> dict:
    """``n_tensors`` weight tensors plus Adam moments totalling about ``total_mb`` MiB."""
    per = max(1024, (total_mb << 20) // 3 // n_tensors // 4)
    g = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.w": torch.randn(per, generator=g) for i in range(n_tensors)}
    return {
        "model": weights,
        "optim": {
            "exp_avg": {k: torch.randn(per, generator=g) for k in weights},
            "exp_avg_sq": {k: torch.rand(per, generator=g) for k in weights},
        },
        "step": 0,
    }


def tensors_of(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    return []


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def memcpy_s(state, repeats: int = 3) -> float:
    src = tensors_of(state)
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src):  # fault the destination pages in first: preallocated memory
        d.copy_(s)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        best = min(best, time.perf_counter() - t0)
    return best


def fsync_dir_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class Methods:
    """Each method: ``start(step, state)`` returns the seconds training was blocked; ``drain()`` waits."""

    def __init__(self, work: Path) -> None:
        import tiersave

        self.work = Path(tempfile.mkdtemp(dir=work))  # each measurement starts from an empty root
        self.ckpt = tiersave.Checkpointer(self.work / "tiersave", keep_last=2)
        self.lazy_ckpt = tiersave.Checkpointer(self.work / "tiersave-lazy", keep_last=2)
        self._dcp_future = None
        self._dcp_dirs: list[str] = []

    def tiersave(self, step: int, state) -> float:
        self._n = getattr(self, "_n", 0) + 1  # steps must be new: repeated runs reuse step numbers
        t0 = time.perf_counter()
        handle = self.ckpt.save_async(self._n, state)
        blocked = time.perf_counter() - t0
        self._last = handle
        return blocked

    def tiersave_lazy(self, step: int, state) -> float:
        """The time ``save_async(lazy=True)`` blocks; the guard's ``waited_s`` adds what ``step()`` waits."""
        self._nl = getattr(self, "_nl", 0) + 1
        t0 = time.perf_counter()
        self.lazy_ckpt.save_async(self._nl, state, lazy=True)
        return time.perf_counter() - t0

    def torch_save(self, step: int, state) -> float:
        path = self.work / "torch" / f"{step}.pt"
        path.parent.mkdir(exist_ok=True)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        blocked = time.perf_counter() - t0
        for old in sorted(path.parent.glob("*.pt"))[:-2]:
            old.unlink()
        return blocked

    def dcp_async(self, step: int, state) -> float:
        import torch.distributed.checkpoint as dcp

        if self._dcp_future is not None:  # DCP does not queue saves: wait for the previous one
            self._dcp_future.result()
        target = str(self.work / "dcp" / str(step))
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._dcp_future = dcp.async_save(state, checkpoint_id=target)
        blocked = time.perf_counter() - t0
        self._dcp_dirs.append(target)
        while len(self._dcp_dirs) > 2:
            shutil.rmtree(self._dcp_dirs.pop(0), ignore_errors=True)
        return blocked

    def drain(self) -> None:
        self.ckpt.wait()
        self.lazy_ckpt.wait()
        if self._dcp_future is not None:
            self._dcp_future.result()
            self._dcp_future = None
        for d in self._dcp_dirs:
            fsync_dir_tree(d)  # DCP's own writer does not fsync; count it for a fair "durable" end

    def close(self) -> None:
        self.drain()
        self.ckpt.close()
        self.lazy_ckpt.close()


def stall(work: Path, state, rounds: int, window: float) -> dict:
    """Median blocked seconds per method over ``rounds``, the methods interleaved in every round."""
    m = Methods(work)
    module, optim = as_module_and_adam(state)
    guard = m.lazy_ckpt.guard(optim)
    lazy_state = {"model": module, "optim": optim}

    def lazy(window_s: float):
        def run(step: int, _state) -> float:
            blocked = m.tiersave_lazy(step, lazy_state)
            time.sleep(window_s)  # forward and backward: the CPU is free (a GPU computes)
            before = guard.waited_s
            optim.step()  # no gradients: Adam changes nothing, but its guard's hook waits as in training
            return blocked + guard.waited_s - before

        return run

    methods = {
        "tiersave save_async": m.tiersave,
        "tiersave lazy, step() at once": lazy(0.0),
        f"tiersave lazy, step() after {window:g} s": lazy(window),
        "torch.save+fsync": m.torch_save,
        "DCP async_save": m.dcp_async,
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    for fn in methods.values():
        fn(0, state)  # warm-up: allocations, imports, plan caches
        m.drain()
    names = list(methods)
    for r in range(1, rounds + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated, as in training_overhead
            fn = methods[name]
            times[name].append(fn(r, state))
            m.drain()
    m.close()
    return {name: statistics.median(t) for name, t in times.items()}


class Trainer:
    """An MLP training step whose parameters and Adam state are the checkpointed state."""

    def __init__(self, width: int, depth: int) -> None:
        torch.manual_seed(0)
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.model = torch.nn.Sequential(*layers)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(256, width)
        self.step_fn()  # allocate Adam state

    def step_fn(self) -> None:
        loss = self.model(self.x).square().mean()
        self.optim.zero_grad()
        loss.backward()
        self.optim.step()

    def state(self) -> dict:
        return {"model": self.model, "optim": self.optim}


def training_overhead(work: Path, steps: int, every: int, width: int, depth: int, repeats: int) -> dict:
    """Wall time of the loop per method: the runs are interleaved ``repeats`` times, each figure is the median
    of a method's runs (and its range is kept)."""
    trainer = Trainer(width, depth)
    m = Methods(work)
    guard = m.lazy_ckpt.guard(trainer.optim, trainer.model)
    runs = [
        ("no checkpoints", None),
        ("tiersave save_async", m.tiersave),
        ("tiersave lazy", m.tiersave_lazy),
        ("torch.save+fsync", m.torch_save),
        ("DCP async_save", m.dcp_async),
    ]
    walls: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in runs}
    for rep in range(repeats):
        # the order rotates every repetition: a run pays for what the previous one left behind (freed memory the
        # host took back, the disk's writeback), so no method should always follow the same one
        for name, fn in runs[rep % len(runs) :] + runs[: rep % len(runs)]:
            if fn is not None:
                fn(0, trainer.state() if fn is not m.dcp_async else _plain(trainer))
                m.drain()
            blocked = 0.0
            waited_before = guard.waited_s
            t0 = time.perf_counter()
            for step in range(1, steps + 1):
                trainer.step_fn()
                if fn is not None and step % every == 0:
                    blocked += fn(step, trainer.state() if fn is not m.dcp_async else _plain(trainer))
            m.drain()  # the run is over when its last checkpoint is durable
            wall = time.perf_counter() - t0
            blocked += guard.waited_s - waited_before  # the lazy method's step() waits (0 for the others)
            walls[name].append((wall, blocked))
    m.close()
    results = {
        name: {
            "wall_s": statistics.median(w for w, _ in reps),
            "blocked_s": statistics.median(b for _, b in reps),
            "wall_range_s": [min(w for w, _ in reps), max(w for w, _ in reps)],
        }
        for name, reps in walls.items()
    }
    base = results["no checkpoints"]["wall_s"]
    for r in results.values():
        r["overhead"] = r["wall_s"] / base - 1
    ckpt_mb = state_bytes(_plain(trainer)) / 2**20
    step_s = results["no checkpoints"]["wall_s"] / steps
    return {
        "steps": steps, "every": every, "repeats": repeats, "checkpoint_mib": round(ckpt_mb, 1),
        "step_s": step_s, "runs": results,
    }  # fmt: skip


def _plain(trainer: Trainer) -> dict:
    """DCP saves dict state (it calls state_dict() on Stateful objects itself, but not on an Optimizer)."""
    return {"model": trainer.model.state_dict(), "optim": trainer.optim.state_dict()}


MEMORY_PROBE = """
import sys, torch, tiersave
sys.path.insert(0, {bench_dir!r})
from async_save import gpt_like_state, state_bytes
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
state = gpt_like_state({mb})
base = rss()
ckpt = tiersave.Checkpointer({root!r}, keep_last=1, staging_bytes={budget})
for step in range(1, 4):
    ckpt.save(step, state)
warm = rss()
for step in range(4, 24):
    ckpt.save_async(step, state)
ckpt.wait()
end = rss()
ckpt.close()
def peak():  # VmHWM: this process's high-water mark (ru_maxrss keeps the parent's across fork+exec)
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM:'))
print(base, warm, end, peak(), state_bytes(state))
"""


def memory(work: Path, mb: int, budget: int) -> dict:
    code = MEMORY_PROBE.format(bench_dir=str(Path(__file__).parent), mb=mb, root=str(work / "mem"), budget=budget)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, warm, end, peak, nbytes = map(int, out.stdout.split())
    return {
        "state_bytes": nbytes,
        "staging_budget": budget,
        "rss_before_saves": base,
        "peak_rss": peak,
        "peak_over_before_plus_budget": peak / (base + budget),
        "growth_over_20_saves": end - warm,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=int, default=1024, help="state size for the stall test (MiB)")
    p.add_argument("--rounds", type=int, default=3, help="timed saves per method for the stall test")
    p.add_argument("--steps", type=int, default=60, help="training steps per run")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    p.add_argument("--width", type=int, default=2048, help="MLP width (state = 3 x width^2 x depth x 4 bytes)")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of the training runs")
    p.add_argument("--window", type=float, default=0.3, help="seconds of forward+backward before step() (stall)")
    p.add_argument("--skip-memory", action="store_true", help="leave out the memory probe")
    p.add_argument("--dir", default=None, help="work directory on the disk to test (default: a temp dir here)")
    p.add_argument("--json", default=None, help="write the results to this file")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tiersave-async-", dir=args.dir or "."))
    torch.set_num_threads(os.cpu_count() or 1)
    load_start = os.getloadavg()[0]
    try:
        state = gpt_like_state(args.state_mb)
        nbytes = state_bytes(state)
        mc = memcpy_s(state)
        blocked = stall(work, state, args.rounds, args.window)
        del state
        train = training_overhead(work, args.steps, args.every, args.width, args.depth, args.repeats)
        mem = None if args.skip_memory else memory(work, min(args.state_mb, 512), 256 << 20)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "machine": {"cpus": os.cpu_count(), "load_1min": [load_start, os.getloadavg()[0]], "torch": torch.__version__},
        "stall": {
            "state_bytes": nbytes,
            "memcpy_s": mc,
            "methods": {k: {"blocked_s": v, "x_memcpy": v / mc} for k, v in blocked.items()},
        },
        "training": train,
        "memory": mem,
    }
    print(f"load average (1 min) {load_start:.2f} -> {report['machine']['load_1min'][1]:.2f}")
    print(
        f"state {nbytes / 2**30:.2f} GiB; one memcpy into preallocated memory: {mc * 1e3:.0f} ms "
        f"({nbytes / mc / 1e9:.1f} GB/s)"
    )
    print(f"{'method':34} {'blocked ms':>10} {'x memcpy':>9}")
    for k, v in report["stall"]["methods"].items():
        print(f"{k:34} {v['blocked_s'] * 1e3:10.0f} {v['x_memcpy']:9.2f}")
    print(
        f"\ntraining loop: {train['steps']} steps of {train['step_s']:.2f} s, a {train['checkpoint_mib']} MiB "
        f"checkpoint every {train['every']}; medians of {train['repeats']} interleaved runs"
    )
    print(f"{'method':34} {'wall s':>8} {'blocked s':>9} {'overhead':>9}")
    for k, v in train["runs"].items():
        print(f"{k:34} {v['wall_s']:8.2f} {v['blocked_s']:9.2f} {v['overhead'] * 100:8.1f}%")
    if mem is not None:
        print(
            f"\nmemory: peak RSS {mem['peak_rss'] / 2**20:.0f} MiB for a {mem['state_bytes'] / 2**20:.0f} MiB "
            f"state and a {mem['staging_budget'] / 2**20:.0f} MiB staging budget "
            f"({mem['peak_over_before_plus_budget']:.2f}x of RSS-before-saves + budget); growth over 20 saves "
            f"{mem['growth_over_20_saves'] / 2**20:.1f} MiB"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
