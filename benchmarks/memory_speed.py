"""Issue 16's memory-speed table: the memory tier and the buffered path against their yardsticks, one run.

Every figure comes from the same process, state and moment, the methods interleaved with the order rotated
every rep, and is the median of ``--reps`` (>= 3) with its range:

- ``memcpy``: one ``memcpy(3)`` per tensor (``ctypes.memmove``, glibc, on the caller's thread) into
  preallocated memory touched beforehand: the floor of any copy of the state's bytes;
- ``torch copy_``: ``Tensor.copy_`` into preallocated tensors (torch's own, multi-threaded copy);
- restore from ``mem://`` into the live state, and into new tensors (every byte CRC-checked, as always);
- ``pread`` of the same files from the memory tier into the live tensors with no checks: the kernel's copy
  out of tmpfs alone, the limit of any restore that reads the files;
- ``save_async`` into ``mem://``: the time the caller is blocked (staging arena warm);
- the DLRover-like reference: a copy (``Tensor.copy_``) of every tensor into one preallocated, touched
  shared-memory buffer in ``/dev/shm``, reused by every save, which is what DLRover's flash checkpoint
  blocks the training process for; and the same copy by ``memcpy(3)``, its floor;
- ``Checkpointer(LocalStorage(DIR, io="buffered")).save`` (blocking, until durable) against a plain
  buffered ``write`` of the same bytes to one file followed by ``fsync``.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/memory_speed.py --dir DIR --state-mb 1024 --reps 3 \
        --json benchmarks/results/memory_speed.json

Prints a markdown table with each target checked and the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from async_save import gpt_like_state, state_bytes, tensors_of

import tiersave
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage


def _addr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


def _timed_copies(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, memcpy: bool) -> float:
    """Seconds to copy each source into its destination: ``memcpy(3)``, or torch's ``Tensor.copy_``."""
    t0 = time.perf_counter()
    for d, s in zip(dsts, srcs):
        if memcpy:
            ctypes.memmove(_addr(d), _addr(s), s.numel() * s.element_size())
        else:
            d.copy_(s)
    return time.perf_counter() - t0


class Bench:
    """The state, its live twin and the reference buffers, and one timed function per method."""

    def __init__(self, state_mb: int, work: Path) -> None:
        self.state = gpt_like_state(state_mb)
        self.nbytes = state_bytes(self.state)
        self.src = tensors_of(self.state)
        self.live = {
            "model": {k: torch.empty_like(v) for k, v in self.state["model"].items()},
            "optim": {m: {k: torch.empty_like(v) for k, v in d.items()} for m, d in self.state["optim"].items()},
            "step": 0,
        }
        self.dst = tensors_of(self.live)
        for t in self.dst:
            t.zero_()  # touched: a live training state
        self.work = work
        # DLRover-like: one shared-memory buffer, preallocated and touched, tensors laid out in it
        self.shm_path = Path("/dev/shm") / f"tiersave-bench-dlrover-{uuid.uuid4().hex[:8]}"
        with open(self.shm_path, "wb") as f:
            f.truncate(self.nbytes)
        fd = os.open(self.shm_path, os.O_RDWR)
        try:
            self.shm = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        flat = torch.frombuffer(self.shm, dtype=torch.uint8)
        flat.fill_(1)
        self.shm_views: list[torch.Tensor] = []
        off = 0
        for t in self.src:
            n = t.numel() * t.element_size()
            self.shm_views.append(flat[off : off + n].view(t.dtype).view(t.shape))
            off += n
        self.mem_name = f"bench-{uuid.uuid4().hex[:8]}"
        self.mem = tiersave.Checkpointer(f"mem://{self.mem_name}", keep_last=2)
        self.buf_root = Path(tempfile.mkdtemp(dir=work, prefix="buffered-"))
        self.buffered = tiersave.Checkpointer(LocalStorage(self.buf_root, io="buffered"), keep_last=1)
        self.plain_path = work / f"plain-{uuid.uuid4().hex[:8]}.bin"
        self.step = 0
        self.buffered_stage_s: list[float] = []
        self.buffered_unstaged = False

    def memcpy(self) -> float:
        return _timed_copies(self.dst, self.src, memcpy=True)

    def torch_copy(self) -> float:
        return _timed_copies(self.dst, self.src, memcpy=False)

    def mem_into(self) -> float:
        t0 = time.perf_counter()
        self.mem.restore(into=self.live)
        return time.perf_counter() - t0

    def mem_new(self) -> float:
        t0 = time.perf_counter()
        out = self.mem.restore()
        seconds = time.perf_counter() - t0
        del out
        return seconds

    def mem_pread(self) -> float:
        """The kernel's copy out of tmpfs alone: every shard file of the latest step read into the live
        tensors' bytes by ``preadv``, no checks."""
        step_dir = self._latest_mem_dir()
        files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20)
        views = [memoryview(t.numpy()).cast("B") for t in self.dst]
        t0 = time.perf_counter()
        i = 0
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                off, size = 0, os.fstat(fd).st_size
                while off < size and i < len(views):
                    n = os.preadv(fd, [views[i]], off)
                    off += n
                    i += 1
            finally:
                os.close(fd)
        return time.perf_counter() - t0

    def _latest_mem_dir(self) -> Path:
        root = MemoryStorage(self.mem_name, create=False).root
        return max((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")), key=lambda p: p.name)

    def mem_save_async(self) -> float:
        self.mem.wait()
        self.step += 1
        t0 = time.perf_counter()
        self.mem.save_async(self.step, self.state)
        seconds = time.perf_counter() - t0
        self.mem.wait()
        return seconds

    def dlrover_shm(self) -> float:
        return _timed_copies(self.shm_views, self.src, memcpy=False)

    def shm_memcpy(self) -> float:
        """The same copy into the shared-memory buffer with ``memcpy(3)``: the floor of any such save."""
        return _timed_copies(self.shm_views, self.src, memcpy=True)

    def buffered_save(self) -> float:
        self.step += 1
        t0 = time.perf_counter()
        handle = self.buffered.save(self.step, self.state)
        seconds = time.perf_counter() - t0
        self.buffered_stage_s.append(handle.stats.stage_s)  # the copy into the arena, which a plain write skips
        self.buffered_unstaged = bool(handle.stats.extra.get("unstaged"))  # no copy: stage_s is then the writes
        return seconds

    def plain_write(self) -> float:
        t0 = time.perf_counter()
        fd = os.open(self.plain_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for s in self.src:
                view = memoryview(s.numpy()).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        seconds = time.perf_counter() - t0
        self.plain_path.unlink()
        return seconds

    def close(self) -> None:
        self.mem.close()
        self.buffered.close()
        MemoryStorage(self.mem_name).destroy()
        self.shm.close()
        self.shm_path.unlink(missing_ok=True)
        shutil.rmtree(self.buf_root, ignore_errors=True)
        self.plain_path.unlink(missing_ok=True)


BEGIN = "<!-- memory-speed:begin -->"
END = "<!-- memory-speed:end -->"


def update_docs(path: Path, text: str) -> None:
    """Put ``text`` between the BEGIN and END markers of ``path``; both must be there, once each."""
    doc = path.read_text()
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        raise SystemExit(f"{path}: needs one {BEGIN} line followed by one {END} line")
    head, rest = doc.split(BEGIN)
    _, tail = rest.split(END)
    path.write_text(f"{head}{BEGIN}\n{text.strip()}\n{END}{tail}")


def _row(name: str, values: list[float], nbytes: int) -> dict[str, Any]:
    med = statistics.median(values)
    return {"name": name, "median_s": med, "min_s": min(values), "max_s": max(values), "gbps": nbytes / med / 1e9,
            "all_s": values}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="a directory on the local disk (the buffered saves go there)")
    p.add_argument("--state-mb", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-disk", action="store_true", help="only the memory-tier rows (no disk writes)")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--update-docs",
        default=None,
        metavar="FILE",
        help=f"replace the text between {BEGIN} and {END} in FILE (docs/benchmarks.md) with the tables",
    )
    args = p.parse_args()
    if args.reps < 3:
        p.error("--reps must be at least 3 (a median of three or more)")
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="memory-speed-"))
    b = Bench(args.state_mb, work)
    methods: dict[str, Callable[[], float]] = {
        "memcpy": b.memcpy,
        "torch copy_": b.torch_copy,
        "pread from mem:// (no checks)": b.mem_pread,
        "restore mem:// into live": b.mem_into,
        "restore mem:// new tensors": b.mem_new,
        "save_async into mem:// (blocked)": b.mem_save_async,
        "DLRover-like shared-memory copy": b.dlrover_shm,
        "memcpy into the shared-memory buffer": b.shm_memcpy,
    }
    if not args.skip_disk:
        methods["io=buffered save (durable)"] = b.buffered_save
        methods["plain buffered write + fsync"] = b.plain_write
    times: dict[str, list[float]] = {k: [] for k in methods}
    try:
        b.mem.save(0, b.state)  # warm-up: the staging arena, the thread pools, the first touch of tmpfs
        for fn in methods.values():
            fn()
        names = list(methods)
        for rep in range(args.reps):
            for k in names[rep % len(names) :] + names[: rep % len(names)]:
                times[k].append(methods[k]())
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        b.close()
        shutil.rmtree(work, ignore_errors=True)
    load_end = os.getloadavg()
    rows = {k: _row(k, v, b.nbytes) for k, v in times.items()}
    med = {k: float(r["median_s"]) for k, r in rows.items()}

    def ratio(a: str, ref: str) -> float:
        return med[ref] / med[a]

    checks = [
        ("restore mem:// into live >= 0.7x memcpy", ratio("restore mem:// into live", "memcpy"), 0.7, True),
        ("restore mem:// new tensors >= 0.7x memcpy", ratio("restore mem:// new tensors", "memcpy"), 0.7, True),
        ("pread alone (the kernel's copy out of tmpfs, no checks) vs memcpy",
         ratio("pread from mem:// (no checks)", "memcpy"), 0.0, False),
        ("restore mem:// into live vs pread alone", ratio("restore mem:// into live", "pread from mem:// (no checks)"),
         0.0, False),
        ("save_async into mem:// blocks <= DLRover-like copy (time ratio <= 1)",
         med["save_async into mem:// (blocked)"] / med["DLRover-like shared-memory copy"], 1.0, False),
        ("save_async into mem:// blocked vs memcpy into the shared-memory buffer (time ratio)",
         med["save_async into mem:// (blocked)"] / med["memcpy into the shared-memory buffer"], 0.0, False),
    ]  # fmt: skip
    if not args.skip_disk:
        buffered = med["io=buffered save (durable)"] / med["plain buffered write + fsync"]
        checks.append(("io=buffered save no slower than plain write + fsync (time ratio <= 1)", buffered, 1.0, False))
    lines: list[str] = []
    lines.append(
        f"state {b.nbytes / 1e9:.3f} GB, {len(b.src)} tensors; {args.reps} interleaved reps; "
        f"load average (1 min) {load_start[0]:.2f} -> {load_end[0]:.2f}; {os.cpu_count()} CPUs; "
        f"finished {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    lines.append("")
    lines.append("| method | median ms | range ms | GB/s |")
    lines.append("| --- | --- | --- | --- |")
    lines.extend(
        f"| {r['name']} | {r['median_s'] * 1e3:.0f} | {r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f} | {r['gbps']:.2f} |"
        for r in rows.values()
    )
    lines.append("")
    lines.append("| target | measured | verdict |")
    lines.append("| --- | --- | --- |")
    verdicts = []
    for name, value, bound, higher in checks:
        if bound == 0.0:
            verdict = "(diagnostic)"
        else:
            ok = value >= bound if higher else value <= bound
            verdict = "met" if ok else "**missed**"
        verdicts.append({"target": name, "value": value, "verdict": verdict})
        lines.append(f"| {name} | {value:.2f}x | {verdict} |")
    if b.buffered_stage_s:
        lines.append("")
        stage_ms = statistics.median(b.buffered_stage_s) * 1e3
        if b.buffered_unstaged:
            lines.append(f"io=buffered save: written from the tensors, no staging copy; its writes into the page "
                         f"cache took {stage_ms:.0f} ms (median), the rest is the fsync and the commit")  # fmt: skip
        else:
            lines.append(f"io=buffered save: the staging copy took {stage_ms:.0f} ms (median), a copy the plain "
                         "write does not make")  # fmt: skip
    lines.append("")
    lines.append(f"Command: `PYTHONPATH=src .venv/bin/python benchmarks/memory_speed.py {' '.join(sys.argv[1:])}`")
    print("\n" + "\n".join(lines))
    if args.update_docs:
        update_docs(Path(args.update_docs), "\n".join(lines))
    if args.json:
        out = {"state_bytes": b.nbytes, "tensors": len(b.src), "reps": args.reps, "load_start": load_start,
               "load_end": load_end, "cpus": os.cpu_count(), "rows": rows, "checks": verdicts}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
