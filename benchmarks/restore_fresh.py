"""A restore as a resumed job does it, in a process that has just started, against raw reads that land in
memory the same way: what the first touch of new memory costs, next to what the device gives.

`tiersave bench` restores over and over in one process, so the allocator hands each round memory an earlier
round freed, already faulted in; a job that resumes restores once, into memory it has never touched, and
every page of the state is faulted in on the way. Here every measurement runs in a new process (the bench's
GPT-like state, saved once with ``io="direct"``; the page cache dropped where the process may, else evicted
with ``fadvise``), the order reversed every round:

- ``raw, one buffer``: the bench's raw read, one stream of 16 MiB ``O_DIRECT`` reads into one buffer used
  again for every block: the device alone;
- ``raw, new memory xN``: the same file read direct with N streams into a private anonymous mapping made for
  the read, so that every page is faulted in (by the kernel, as it pins the pages for the read);
- ``restore new``: ``Checkpointer.restore(step)``, the first restore of the process, into new tensors;
- ``restore into``: ``restore(step, into=state)`` into a live state allocated and written (so faulted in)
  before the timed call, as a model and optimizer are when a job resumes into them.

Prints the date, the load and the settings, then per round the throughputs, then per method the median and
range and the memory the timed call made resident for the first time (the growth of the process's resident set
across the call, read from ``/proc/self/statm``: the same figure whatever the page size or huge pages).

Usage::

    .venv/bin/python benchmarks/restore_fresh.py --dir DIR --gb 3 --rounds 5
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from save_vs_raw import RAW_BLOCK as BLOCK
from save_vs_raw import refuse_unless_empty, write_raw

METHODS = ("raw, one buffer", "raw, new memory x1", "raw, new memory x4", "restore new", "restore into")


def _resident() -> int:
    """Bytes of this process's resident set (Linux)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def _die_with_parent() -> None:
    """In a child, before exec: be killed when the parent dies (a timed-out parent leaves no child reading)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _raw(path: Path, streams: int, new_memory: bool) -> tuple[float, int]:
    from tiersave.storage.posix.calibration import ThreadBuffers, run_blocks
    from tiersave.storage.posix.directio import open_direct

    size = path.stat().st_size
    fd = open_direct(path, os.O_RDONLY)
    if fd is None:
        raise SystemExit(f"{path.parent} refuses O_DIRECT: there is no raw direct read to compare with")
    try:
        if new_memory:
            area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            view = memoryview(area)
            r0 = _resident()
            seconds = run_blocks(streams, size, BLOCK, lambda off, k: os.preadv(fd, [view[off : off + k]], off))
            grown = _resident() - r0
            view.release()
            area.close()
            return seconds, grown
        bufs = ThreadBuffers(BLOCK)
        buf = bufs.get(BLOCK)
        buf[:] = bytes(BLOCK)  # this thread's buffer, written (so resident) before the clock starts
        r0 = _resident()
        seconds = run_blocks(1, size, BLOCK, lambda off, k: os.preadv(fd, [bufs.get(k)], off))
        return seconds, _resident() - r0
    finally:
        os.close(fd)


def _restore(root: Path, gb: float, into: bool) -> tuple[float, int]:
    from tiersave.bench.workload import empty_like_state, gpt_like_spec
    from tiersave.checkpointer import Checkpointer
    from tiersave.storage.posix import LocalStorage

    ck = Checkpointer(LocalStorage(root, io="direct"))
    try:
        state = None
        if into:  # zero-filled, so written and resident, as a live model's memory is
            state = empty_like_state(gpt_like_spec("llama3-8b", int(gb * 1e9)))
        r0 = _resident()
        start = time.perf_counter()
        restored = ck.restore(1, into=state)
        seconds = time.perf_counter() - start
        grown = _resident() - r0  # while the restored tensors are still held
        del restored
        return seconds, grown
    finally:
        ck.close()


def child(args: argparse.Namespace) -> None:
    from tiersave.bench.device import evict

    raw = args.dir / "raw.bin"
    evict([args.dir])
    method = args.child
    if method.startswith("raw"):
        new_memory = "new memory" in method
        seconds, grown = _raw(raw, int(method[-1]) if new_memory else 1, new_memory)
    else:
        seconds, grown = _restore(args.dir / "ck", args.gb, into=method == "restore into")
    print(json.dumps({"seconds": seconds, "resident_growth": grown}))


def prepare(args: argparse.Namespace) -> int:
    """Write the raw file (refused where O_DIRECT is) and save the state once; returns the state's bytes."""
    from tiersave.bench.workload import build_state, gpt_like_spec
    from tiersave.checkpointer import Checkpointer
    from tiersave.storage.posix import LocalStorage

    state = build_state(gpt_like_spec("llama3-8b", int(args.gb * 1e9)), seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    block = mmap.mmap(-1, BLOCK)
    block[:] = os.urandom(1 << 20) * (BLOCK >> 20)
    write_raw(args.dir / "raw.bin", nbytes, memoryview(block))
    with Checkpointer(LocalStorage(args.dir / "ck", io="direct")) as ck:
        ck.save(1, state)
    return nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, type=Path, help="where to write (on the file system to measure)")
    ap.add_argument("--gb", type=float, default=3.0, help="state size in GB (default 3)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    refuse_unless_empty(ap, args.dir, args.json)  # and it is removed at the end
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.2f}, "
          f"--gb {args.gb} --rounds {args.rounds}, directory {args.dir}", flush=True)  # fmt: skip
    try:
        nbytes = prepare(args)
        gbps: dict[str, list[float]] = {m: [] for m in METHODS}
        grown: dict[str, list[int]] = {m: [] for m in METHODS}
        cmd = [sys.executable, __file__, "--dir", str(args.dir), "--gb", str(args.gb), "--child"]
        limit = 120 + 120 * args.gb
        for rnd in range(args.rounds):
            for method in METHODS if rnd % 2 == 0 else METHODS[::-1]:
                try:
                    done = subprocess.run(
                        [*cmd, method], capture_output=True, text=True, timeout=limit, check=False,
                        preexec_fn=_die_with_parent,
                    )  # fmt: skip
                except subprocess.TimeoutExpired:
                    raise SystemExit(f"{method}: no result within {limit:.0f} s") from None
                if done.returncode != 0:
                    raise SystemExit(f"{method}: {done.stderr[-2000:]}")
                out = json.loads(done.stdout.strip().splitlines()[-1])
                gbps[method].append(nbytes / out["seconds"] / 1e9)
                grown[method].append(out["resident_growth"])
            line = "  ".join(f"{m} {v[-1]:.2f}" for m, v in gbps.items())
            print(f"round {rnd + 1}: {line} GB/s; load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        shutil.rmtree(args.dir, onerror=lambda fn, path, exc: print(f"could not remove {path}: {exc[1]}"))
    summary = {}
    for m, values in gbps.items():
        touched = statistics.median(grown[m]) / 1e9
        summary[m] = {"median_gbps": statistics.median(values), "range_gbps": [min(values), max(values)]}
        summary[m]["new_resident_gb"] = touched
        print(f"{m:20s} median {statistics.median(values):.2f} GB/s ({min(values):.2f}-{max(values):.2f}), "
              f"made {touched:.2f} GB resident")  # fmt: skip
    if args.json:
        settings = {"gb": args.gb, "rounds": args.rounds, "dir": str(args.dir), "time": time.time()}
        doc = {"settings": settings, "bytes": nbytes, "gbps": gbps, "resident_growth": grown, "summary": summary}
        args.json.write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
