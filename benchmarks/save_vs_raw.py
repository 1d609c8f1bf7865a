"""A blocking save against the raw device, alone in one process: the figure `tiersave bench` reports with the
peers' rounds in between, measured without them.

`tiersave bench` puts every contender through the same rounds, so between two tiersave saves the device also
takes torch.save's buffered writes, safetensors', DCP's and their deletes; on a shared virtual disk what one
contender leaves (writeback, discards) lands on the next. This script alternates only the bench's raw direct
write (one stream of 16 MiB ``O_DIRECT`` writes from one buffer, then ``fsync``) and tiersave's blocking
``Checkpointer.save`` (``io="direct"``) of the bench's GPT-like state with each I/O thread count of
``--threads``, in an order that reverses every round, so the ratio of each round is taken seconds apart.

Prints per round the throughputs and the load average, then per method the median and range, and the median
over the rounds of the ratio to that round's raw write (``/raw``).

Usage::

    .venv/bin/python benchmarks/save_vs_raw.py --dir DIR --gb 3 --rounds 8 --threads 1,2,4
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tiersave.bench.workload import build_state, gpt_like_spec
from tiersave.checkpointer import Checkpointer
from tiersave.storage.posix import LocalStorage
from tiersave.storage.posix.calibration import run_blocks
from tiersave.storage.posix.directio import open_direct

RAW_BLOCK = 16 << 20


def refuse_unless_empty(ap: argparse.ArgumentParser, directory: Path, output: Path | None = None) -> None:
    """Exit with a usage error unless ``directory`` is new or an empty directory (not a link): the benchmarks
    remove what they write there. With ``output`` (a benchmark that removes ``directory`` whole), also unless
    that file lies outside it."""
    if directory.is_symlink() or (directory.exists() and (not directory.is_dir() or any(directory.iterdir()))):
        ap.error(f"--dir {directory}: give a new or empty directory, not a link (what it writes there is removed)")
    if output is not None and directory.resolve() in output.resolve().parents:
        ap.error("--json must lie outside --dir, which is removed at the end")


def write_raw(path: Path, nbytes: int, block: memoryview) -> float:
    """Seconds of the bench's raw write: one stream of direct writes of ``block`` into a new file of ``nbytes``
    rounded up to a block, + fsync. The file stays."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    dfd: int | None = None
    try:
        dfd = open_direct(path, os.O_WRONLY)
        if dfd is None:
            raise SystemExit(f"{path.parent} refuses O_DIRECT: there is no raw direct I/O to compare with")
        size = nbytes + (-nbytes) % 4096  # direct writes end on a block, as the bench's raw write does
        start = time.perf_counter()
        run_blocks(1, size, RAW_BLOCK, lambda off, k: os.pwrite(dfd, block[:k], off))
        os.fsync(dfd)
        return time.perf_counter() - start
    finally:
        if dfd is not None:
            os.close(dfd)
        os.close(fd)


def raw_write(path: Path, nbytes: int, block: memoryview) -> float:
    """:func:`write_raw`, then the file removed (outside the time)."""
    try:
        return write_raw(path, nbytes, block)
    finally:
        path.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, type=Path, help="where to write (on the file system to measure)")
    ap.add_argument("--gb", type=float, default=3.0, help="state size in GB (default 3)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", default="1,2,4", help="tiersave I/O thread counts, comma-separated")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between two measurements")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    refuse_unless_empty(ap, args.dir)
    args.dir.mkdir(parents=True, exist_ok=True)
    state = build_state(gpt_like_spec("llama3-8b", int(args.gb * 1e9)), seed=0)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    area = mmap.mmap(-1, RAW_BLOCK)
    area[:] = os.urandom(1 << 20) * (RAW_BLOCK >> 20)
    block = memoryview(area)
    ckpts: dict[int, Checkpointer] = {}
    steps = dict.fromkeys(threads, 0)

    def save(n: int) -> float:
        steps[n] += 1
        start = time.perf_counter()
        ckpts[n].save(steps[n], state)
        seconds = time.perf_counter() - start
        ckpts[n].wait()  # the previous step's deletion (keep_last=1) ends here, not in the next measurement
        return seconds

    methods: list[tuple[str, Callable[[], float]]] = [("raw", lambda: raw_write(args.dir / "raw.bin", nbytes, block))]
    methods += [(f"tiersave x{n}", lambda n=n: save(n)) for n in threads]
    try:
        for n in threads:  # the staging arena is allocated by the first save, as in a training job
            ckpts[n] = Checkpointer(LocalStorage(args.dir / f"t{n}", io="direct"), io_threads=n, keep_last=1)
            save(n)
        gbps: dict[str, list[float]] = {name: [] for name, _ in methods}
        for rnd in range(args.rounds):
            for name, run in methods if rnd % 2 == 0 else methods[::-1]:
                time.sleep(args.pause)
                gbps[name].append(nbytes / run() / 1e9)
            line = "  ".join(f"{name} {v[-1]:.2f}" for name, v in gbps.items())
            print(f"round {rnd + 1}: {line} GB/s; load {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        for ck in ckpts.values():
            ck.close()
        for n in threads:
            shutil.rmtree(args.dir / f"t{n}", ignore_errors=True)
    summary = {}
    for name, values in gbps.items():
        to_raw = statistics.median(v / r for v, r in zip(values, gbps["raw"], strict=True))
        summary[name] = {"median_gbps": statistics.median(values), "range_gbps": [min(values), max(values)]}
        summary[name]["median_vs_raw"] = to_raw
        print(f"{name:14s} median {statistics.median(values):.2f} GB/s ({min(values):.2f}-{max(values):.2f}), "
              f"/raw {to_raw:.3f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"bytes": nbytes, "gbps": gbps, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
