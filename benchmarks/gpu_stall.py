"""Issue 16's GPU figures in one command: how long a checkpoint of a CUDA state holds training up, tiersave's
``save_async`` (eager and lazy) next to DCP's ``async_save`` with pinned memory, and the restore into CUDA tensors.

The state is the ``tiersave bench`` GPT-like state (model + two Adam moments) scaled to ``--gb`` and moved to the
device. Per repetition, methods interleaved with the order rotated, every one after a warm-up save that is not
counted (tiersave's pinned staging arena and DCP's pinned stager buffers are allocated once and reused, as in
a training job):

- ``blocked``: the wall time of the call on the training thread;
- ``held``: from the call until the state may be changed: for tiersave eager, until the device-to-host copies
  that the caller's stream waits on are done (a ``torch.cuda.synchronize()`` right after the call: the next
  kernel on that stream would start there); for tiersave lazy, the same for the guarded optimizer's own wait
  (the call returns before the copies, and ``optimizer.step()`` waits for the tensors it writes: here one step
  of a guarded SGD over the whole state, with zero gradients, so the wait covers every copy; the step's own
  time is the row ``optimizer step alone``); for DCP, until its
  ``staging_completion`` future is done (DCP's rule: the state may change only after it);
- ``durable``: until the checkpoint is committed (tiersave) or written and ``fsync``-ed (DCP);
- the floor: a device-to-host copy of every tensor into one preallocated pinned buffer, on a side stream,
  then ``synchronize`` (what any snapshot that leaves the device pays).

Then restores from a cold page cache where the process may drop it (root), else after ``fadvise``: tiersave's
``restore(into=...)`` and DCP's ``load`` into the same CUDA tensors, and the floor of a host-to-device copy
from the pinned buffer. Every restore is compared with the saved values. Medians and ranges of the reps, the
machine (GPU, driver-visible memory, CPUs, torch) and the load average go to stdout and ``--json``.

``--device cpu`` runs the same code on host tensors (no pinned memory, no streams): a check that the script
works anywhere, not a GPU figure.

Usage (on the GPU machine; 10 GB needs about 3x that in host memory for the pinned buffers)::

    PYTHONPATH=src python benchmarks/gpu_stall.py --dir /path/on/local/nvme --gb 10 --reps 3 \\
        --json benchmarks/results/gpu_stall.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tiersave
from tiersave.bench.device import evict
from tiersave.bench.methods import single_process
from tiersave.bench.workload import build_state, gpt_like_spec

State = dict[str, torch.Tensor]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Floor:
    """One pinned host buffer the size of the state: the copy out of the device and back, the floors."""

    def __init__(self, state: State, device: str) -> None:
        self.device = device
        total = sum(t.nbytes for t in state.values())
        self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=device == "cuda")
        self.views: list[torch.Tensor] = []
        offset = 0
        for t in state.values():
            self.views.append(self.buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape))
            offset += t.nbytes
        self.stream = torch.cuda.Stream() if device == "cuda" else None  # type: ignore[no-untyped-call]

    def save(self, state: State) -> dict[str, float]:
        start = time.perf_counter()
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for view, t in zip(self.views, state.values()):
                    view.copy_(t, non_blocking=True)
        else:
            for view, t in zip(self.views, state.values()):
                view.copy_(t)
        blocked = time.perf_counter() - start
        _sync(self.device)
        held = time.perf_counter() - start
        return {"blocked": blocked, "held": held, "durable": held}

    def restore(self, state: State) -> float:
        start = time.perf_counter()
        for view, t in zip(self.views, state.values()):
            t.copy_(view, non_blocking=True)
        _sync(self.device)
        return time.perf_counter() - start


class Tiersave:
    def __init__(self, root: Path, state: State, device: str, lazy: bool) -> None:
        self.device, self.lazy, self.root = device, lazy, root
        # A guarded optimizer over the state: its step is the training's next write to every tensor.
        self.params = [torch.nn.Parameter(t, requires_grad=False) for t in state.values() if t.is_floating_point()]
        for p in self.params:
            p.grad = torch.zeros_like(p)  # allocated once, outside the timed region
        self.optim = torch.optim.SGD(self.params, lr=0.0)
        guard = [self.optim] if lazy else None
        self.ckpt = tiersave.Checkpointer(root, keep_last=2, guard=guard, handle_sigterm=False)
        self.step = 0

    def save(self, state: State) -> dict[str, float]:
        self.step += 1
        start = time.perf_counter()
        handle = self.ckpt.save_async(self.step, state, lazy=self.lazy)
        blocked = time.perf_counter() - start
        if self.lazy:
            self.optim.step()  # waits for the staging of every tensor it writes (lr 0, zero grads: values unchanged)
        _sync(self.device)
        held = time.perf_counter() - start
        handle.result(timeout=3600)
        return {"blocked": blocked, "held": held, "durable": time.perf_counter() - start}

    def paths(self) -> list[Path]:
        return [self.root]

    def restore(self, state: State) -> float:
        start = time.perf_counter()
        self.ckpt.restore(self.step, into=state)
        _sync(self.device)
        return time.perf_counter() - start

    def close(self) -> None:
        self.ckpt.close()


class StepAlone:
    """The guarded optimizer's step with no save in flight: the part of lazy's ``held`` that is the step itself."""

    def __init__(self, lazy: Tiersave, device: str) -> None:
        self.optim, self.device = lazy.optim, device

    def save(self, state: State) -> dict[str, float]:
        start = time.perf_counter()
        self.optim.step()
        _sync(self.device)
        held = time.perf_counter() - start
        return {"blocked": 0.0, "held": held, "durable": 0.0}


class DCPAsync:
    def __init__(self, root: Path, device: str) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.root, self.device, self.index = root, device, 0
        pinned = device == "cuda"
        options = StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=pinned
        )
        self.stager = DefaultStager(options)  # reused: its pinned buffers are cached between saves

    def _dir(self, index: int) -> Path:
        return self.root / f"dcp-{index}"

    def save(self, state: State) -> dict[str, float]:
        from torch.distributed.checkpoint import state_dict_saver

        self.index += 1
        old = self._dir(self.index - 2)
        if old.exists():
            shutil.rmtree(old)
        with single_process():  # DCP warns that it assumes one process: it does here
            start = time.perf_counter()
            response = state_dict_saver.async_save(
                state, checkpoint_id=self._dir(self.index), no_dist=True, async_stager=self.stager
            )
            blocked = time.perf_counter() - start
            if isinstance(response, state_dict_saver.AsyncSaveResponse):
                response.staging_completion.result()
                held = time.perf_counter() - start
                response.upload_completion.result()
            else:  # a stager that stages before returning
                held = blocked
                response.result()
        return {"blocked": blocked, "held": held, "durable": time.perf_counter() - start}

    def paths(self) -> list[Path]:
        return [self._dir(self.index)]

    def restore(self, state: State) -> float:
        from torch.distributed.checkpoint import state_dict_loader

        with single_process():  # DCP warns that it assumes one process: it does here
            start = time.perf_counter()
            state_dict_loader.load(state, checkpoint_id=self._dir(self.index), no_dist=True)
        _sync(self.device)
        return time.perf_counter() - start

    def close(self) -> None:
        self.stager.close()


def _same(a: State, b: State) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a GPU machine, or pass --device cpu to check the script")
    spec = gpt_like_spec(target_bytes=int(args.gb * 1e9))
    state = {k: v.to(device) for k, v in build_state(spec).items()}
    expected = {k: v.cpu() for k, v in state.items()} if args.check else None
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    floor = Floor(state, device)
    lazy = Tiersave(root / "lazy", state, device, lazy=True)
    methods: dict[str, Any] = {
        "d2h copy (floor)": floor,
        "tiersave save_async": Tiersave(root / "eager", state, device, lazy=False),
        "tiersave lazy": lazy,
        "optimizer step alone": StepAlone(lazy, device),
        "dcp async_save (pinned)": DCPAsync(root / "dcp", device),
    }
    saves: dict[str, list[dict[str, float]]] = {name: [] for name in methods}
    restores: dict[str, list[float]] = {"h2d copy (floor)": [], "tiersave restore into": [], "dcp load into": []}
    names = list(methods)
    try:
        for name in names:  # warm-up: allocations, calibration, the stager's buffers
            methods[name].save(state)
        for rep in range(args.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                saves[name].append(methods[name].save(state))
                print(
                    f"rep {rep} {name}: " + ", ".join(f"{k} {v:.3f} s" for k, v in saves[name][-1].items()), flush=True
                )
            readers: list[tuple[str, Callable[[State], float], list[Path]]] = [
                ("h2d copy (floor)", floor.restore, []),
                (
                    "tiersave restore into",
                    methods["tiersave save_async"].restore,
                    methods["tiersave save_async"].paths(),
                ),
                (
                    "dcp load into",
                    methods["dcp async_save (pinned)"].restore,
                    methods["dcp async_save (pinned)"].paths(),
                ),
            ]
            for name, restore, paths in readers[rep % 3 :] + readers[: rep % 3]:
                how = evict(paths, drop_caches=not args.no_drop_caches) if paths else "-"
                for t in state.values():
                    t.zero_()
                restores[name].append(restore(state))
                if expected is not None and not _same({k: v.cpu() for k, v in state.items()}, expected):
                    raise SystemExit(f"{name} restored other values than were saved")
                print(f"rep {rep} {name}: {restores[name][-1]:.3f} s (cold: {how})", flush=True)
    finally:
        for m in methods.values():
            if hasattr(m, "close"):
                m.close()
    nbytes = sum(t.nbytes for t in state.values())
    return {
        "machine": {
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None,
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average": os.getloadavg(),
        },
        "state_bytes": nbytes,
        "tensors": len(state),
        "reps": args.reps,
        "saves": {n: {k: _summary([r[k] for r in rows]) for k in rows[0]} for n, rows in saves.items()},
        "restores": {n: _summary(v) for n, v in restores.items()},
    }


def report(result: dict[str, Any]) -> str:
    gb = result["state_bytes"] / 1e9
    m = result["machine"]
    lines = [
        f"state {gb:.2f} GB, {result['tensors']} tensors, {result['reps']} reps; {m['device']}, {m['cpus']} CPUs, "
        f"torch {m['torch']}, load average {m['load_average'][0]:.2f}",
        "",
        "| save | blocked s | held s | durable s |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in result["saves"].items():
        cells = [
            f"{row[k]['median']:.3f} ({row[k]['min']:.3f}-{row[k]['max']:.3f})" for k in ("blocked", "held", "durable")
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| restore | s | GB/s |", "| --- | --- | --- |"]
    for name, row in result["restores"].items():
        lines.append(f"| {name} | {row['median']:.3f} ({row['min']:.3f}-{row['max']:.3f}) | {gb / row['median']:.2f} |")
    saves = result["saves"]
    dcp = saves["dcp async_save (pinned)"]
    lines.append("")
    for name in ("tiersave save_async", "tiersave lazy"):
        for k in ("blocked", "held"):
            lines.append(f"{name} {k} / dcp async_save {k}: {saves[name][k]['median'] / dcp[k]['median']:.2f}x")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="a directory on the disk to measure (checkpoints are written here)")
    p.add_argument("--gb", type=float, default=10.0, help="state size in GB (default 10)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--no-drop-caches", action="store_true", help="cold reads by fadvise only")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip comparing restores with the state")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    result = run(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
