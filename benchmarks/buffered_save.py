"""A blocking save on buffered storage and into ``mem://``, against a plain write of the same bytes: one process.

In one process, on one GPT-like state (600 fp32 tensors: model + two Adam moments), interleaved with the
order rotated every rep: ``Checkpointer(LocalStorage(DIR, io="buffered")).save`` (blocking, until durable)
against one plain buffered ``write`` of the same bytes into one file + ``fsync``; and a blocking
``Checkpointer("mem://...").save`` against the same plain write into a file in ``/dev/shm`` (no ``fsync``:
tmpfs). Prints one JSON line: the medians and ranges in ms, the CPU time of the process (all its threads,
the kernel's copies into the page cache included; the kernel's writeback threads not), the staging time of
the saves (``stage_s``: with the unstaged path, the time its writes took), their time until committed
(``total_s``: a blocking ``save()`` returns after the first tier's retention, which here deletes the previous
checkpoint), the time the plain write's ``unlink`` of its file took (the same deletion, timed apart), the MiB
whose writeback the save started early, and whether the saves were unstaged.

Meant to compare two versions of tiersave in the same minutes: run it alternately with each version's
``src/`` on ``PYTHONPATH``::

    for i in 1 2 3; do for src in OLD/src src; do
        PYTHONPATH=$src .venv/bin/python benchmarks/buffered_save.py --dir DIR --state-mb 1024 --reps 3
    done; done
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
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from async_save import gpt_like_state, state_bytes, tensors_of

import tiersave
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage


def _plain_write(path: Path, tensors: list[torch.Tensor], *, sync: bool, unlinks: list[float]) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for s in tensors:
            view = memoryview(s.numpy()).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    path.unlink()  # timed apart: what deleting a checkpoint just written costs (retention does it in a save)
    unlinks.append(time.perf_counter() - t1)
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a directory on the local disk")
    p.add_argument("--state-mb", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    state = gpt_like_state(args.state_mb)
    src = tensors_of(state)
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="buffered-save-"))
    mem_name = f"bench-{uuid.uuid4().hex[:8]}"
    buffered = tiersave.Checkpointer(LocalStorage(work / "root", io="buffered"), keep_last=1)
    mem = tiersave.Checkpointer(f"mem://{mem_name}", keep_last=1)
    step = 0
    stage: dict[str, list[float]] = {"buffered save": [], "mem:// save": []}
    durable: dict[str, list[float]] = {"buffered save": [], "mem:// save": []}
    unstaged: dict[str, bool] = {}
    early: dict[str, list[int]] = {"buffered save": [], "mem:// save": []}
    unlinks: dict[str, list[float]] = {"plain write + fsync": [], "plain write to /dev/shm": []}

    def save(name: str, ckpt: tiersave.Checkpointer) -> float:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        handle = ckpt.save(step, state)
        seconds = time.perf_counter() - t0
        stage[name].append(handle.stats.stage_s)
        durable[name].append(handle.stats.total_s)  # committed; save() returns after the retention
        unstaged[name] = bool(handle.stats.extra.get("unstaged"))
        early[name].append(handle.stats.extra.get("io", {}).get("writeback", 0))
        return seconds

    methods: dict[str, Callable[[], float]] = {
        "buffered save": lambda: save("buffered save", buffered),
        "plain write + fsync": lambda: _plain_write(
            work / "plain.bin", src, sync=True, unlinks=unlinks["plain write + fsync"]
        ),
        "mem:// save": lambda: save("mem:// save", mem),
        "plain write to /dev/shm": lambda: _plain_write(
            Path("/dev/shm") / f"tiersave-bench-{uuid.uuid4().hex[:8]}",
            src,
            sync=False,
            unlinks=unlinks["plain write to /dev/shm"],
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    cpu: dict[str, list[float]] = {k: [] for k in methods}  # CPU seconds of this process: less noisy under load
    load = [os.getloadavg()[0]]
    try:
        names = list(methods)
        for rep in range(args.reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                c0 = time.process_time()
                times[name].append(methods[name]())
                cpu[name].append(time.process_time() - c0)
    finally:
        buffered.close()
        mem.close()
        MemoryStorage(mem_name).destroy()
        shutil.rmtree(work, ignore_errors=True)
    load.append(os.getloadavg()[0])
    out = {
        "tiersave": str(Path(tiersave.__file__).parent),
        "bytes": state_bytes(state),
        "load": load,
        "ms": {k: round(statistics.median(v) * 1e3) for k, v in times.items()},
        "range_ms": {k: [round(min(v) * 1e3), round(max(v) * 1e3)] for k, v in times.items()},
        "cpu_ms": {k: round(statistics.median(v) * 1e3) for k, v in cpu.items()},
        "stage_ms": {k: round(statistics.median(v) * 1e3) for k, v in stage.items()},
        "durable_ms": {k: round(statistics.median(v) * 1e3) for k, v in durable.items()},
        "unlink_ms": {k: round(statistics.median(v) * 1e3) for k, v in unlinks.items()},
        "writeback_mb": {k: round(statistics.median(v) / 2**20) for k, v in early.items()},
        "unstaged": unstaged,
    }
    out["ratio buffered"] = round(out["ms"]["buffered save"] / out["ms"]["plain write + fsync"], 3)
    out["ratio mem"] = round(out["ms"]["mem:// save"] / out["ms"]["plain write to /dev/shm"], 3)
    # Until durable (the save's commit; the retention after it deletes the previous checkpoint, which the
    # plain write's figure leaves out): against the plain write alone, and against it + deleting its file.
    plain, unlink = out["ms"]["plain write + fsync"], out["unlink_ms"]["plain write + fsync"]
    out["ratio buffered durable"] = round(out["durable_ms"]["buffered save"] / plain, 3)
    out["ratio buffered with delete"] = round(out["ms"]["buffered save"] / (plain + unlink), 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
