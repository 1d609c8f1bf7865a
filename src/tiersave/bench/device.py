"""The device's own limits and a cold page cache: raw large-block I/O and cache eviction.

Scope: what the benchmark compares against (a raw sequential write and read of the same byte count on
the same file system, with large blocks, direct and buffered) and how it makes every read cold (``fsync``,
``posix_fadvise(DONTNEED)`` on every file, and ``/proc/sys/vm/drop_caches`` where permitted). Torch-free.

The raw figures are the best of a few simple configurations (one stream, several streams), so that the
"device limit" is not understated by a single unlucky choice of queue depth.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..storage.posix.buffers import aligned_buffer
from ..storage.posix.calibration import ThreadBuffers, run_blocks
from ..storage.posix.directio import open_direct

__all__ = ["RawResult", "evict", "measure_raw"]

RAW_BLOCK_BYTES = 16 << 20
"""Block of the raw runs: ``dd bs=16M``, four of the device's 4 MiB requests per system call."""


def _files(paths: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_symlink():
            continue
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            # os.walk skips what vanishes under it: a checkpointer's retention may delete a step meanwhile
            found = (Path(d, f) for d, _, files in os.walk(p) for f in files)
            out += sorted(q for q in found if q.is_file() and not q.is_symlink())
    return out


def evict(paths: Iterable[Path], *, drop_caches: bool = True) -> str:
    """Make the next read of every file under ``paths`` come from the device.

    Each file is ``fsync``-ed (clean pages can be dropped, dirty ones cannot) and advised
    ``POSIX_FADV_DONTNEED``; then, when ``drop_caches`` and the process may, the kernel's whole page cache is
    dropped (``echo 1 > /proc/sys/vm/drop_caches``), which also evicts metadata readahead and anything
    the advice missed.

    Returns:
        ``"drop_caches"`` or ``"fadvise"``: what was done.
    """
    for path in _files(paths):
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    if drop_caches:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError:
            pass
    return "fadvise"


@dataclass
class RawResult:
    """Raw sequential throughput of ``nbytes`` in GB/s, per configuration (``"direct x4"``...)."""

    nbytes: int
    write: dict[str, float] = field(default_factory=dict)
    read: dict[str, float] = field(default_factory=dict)
    direct_refused: bool = False

    @property
    def best_write(self) -> float:
        return max(self.write.values(), default=0.0)

    @property
    def best_read(self) -> float:
        return max(self.read.values(), default=0.0)

    def best_write_config(self) -> str:
        return max(self.write, key=lambda k: self.write[k]) if self.write else ""

    def best_read_config(self) -> str:
        return max(self.read, key=lambda k: self.read[k]) if self.read else ""


def measure_raw(
    directory: Path,
    nbytes: int,
    *,
    streams: tuple[int, ...] = (1, 4),
    block_bytes: int = RAW_BLOCK_BYTES,
    drop_caches: bool = True,
) -> RawResult:
    """Write ``nbytes`` with large direct writes (+ ``fsync``) and read them back cold, direct and buffered.

    Writes use ``O_DIRECT`` from one page-aligned block of random bytes; each configuration in ``streams``
    writes the file anew. Reads evict the file first. Where ``O_DIRECT`` is refused, the raw write is
    buffered + ``fsync`` and ``direct_refused`` is set.
    """
    size = max(block_bytes, nbytes + (-nbytes) % 4096)
    src = aligned_buffer(block_bytes)
    src[:] = (os.urandom(1 << 20) * (block_bytes // (1 << 20) + 1))[:block_bytes]
    result = RawResult(nbytes=size)
    path = directory / f".tiersave-raw-{os.getpid()}.bin"
    bufs = ThreadBuffers(block_bytes)

    try:
        for n in streams:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            dfd: int | None = None
            try:
                dfd = open_direct(path, os.O_WRONLY)
                wfd = dfd if dfd is not None else fd
                result.direct_refused = dfd is None

                def write(off: int, k: int, f: int = wfd) -> int:
                    return os.pwrite(f, src[:k], off)

                t = run_blocks(n, size, block_bytes, write)
                t0 = time.perf_counter()
                os.fsync(wfd)
                t += time.perf_counter() - t0
            finally:
                if dfd is not None:
                    os.close(dfd)
                os.close(fd)
            label = f"{'direct' if dfd is not None else 'buffered'} x{n}"
            result.write[label] = size / t / 1e9
        configs: list[tuple[bool, int]] = [(True, n) for n in streams] + [(False, max(streams))]
        for direct, n in configs:
            evict([path], drop_caches=drop_caches)
            fd2 = open_direct(path, os.O_RDONLY) if direct else os.open(path, os.O_RDONLY)
            if fd2 is None:
                continue

            def read(off: int, k: int, f: int = fd2) -> int:
                return os.preadv(f, [bufs.get(k)], off)

            try:
                t = run_blocks(n, size, block_bytes, read)
            finally:
                os.close(fd2)
            result.read[f"{'direct' if direct else 'buffered'} x{n}"] = size / t / 1e9
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return result
