"""Calibration of the hybrid I/O policy: direct and buffered throughput, measured once per file system.

Scope: measuring direct and buffered write+``fsync`` and cold-read throughput in a storage root
(:func:`calibrate`), the on-disk cache of the results keyed by device and file-system type, this
process's memory of them (:func:`calibration_for`), and the ``TIERSAVE_IO_CALIBRATE*`` knobs.
Anti-scope: deciding a request's path from the figures (:mod:`tiersave.storage.posix.policy`), the
system calls of direct I/O (:mod:`tiersave.storage.posix.directio`).

Calibration writes and reads ``TIERSAVE_IO_CALIBRATION_BYTES`` (128 MiB) with each path in the storage
root, best of two rounds, and caches the result in ``$XDG_CACHE_HOME/tiersave/io-calibration.json``
keyed by device number and file-system type. ``TIERSAVE_IO_CALIBRATE=0`` disables it,
``TIERSAVE_IO_CALIBRATE=refresh`` measures again.

Thread safety: a calibration runs at most once per file system per process; other threads asking for
the same file system wait for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from ...errors import ConfigError
from ...format.layout import new_token
from ...knobs import int_env  # one parser for every TIERSAVE_* integer
from .buffers import address_of, aligned_buffer
from .directio import DEFAULT_BLOCK_BYTES, open_direct
from .safepath import read_regular_file

log = logging.getLogger(__name__)

__all__ = [
    "Calibration",
    "ThreadBuffers",
    "cache_path",
    "calibrate",
    "calibration_bytes",
    "calibration_for",
    "calibration_setting",
    "forget_calibrations",
    "fs_key",
    "run_blocks",
]

_CALIBRATION_VERSION = 1

# -- knobs (TIERSAVE_* variables, read at call time as in tiersave.knobs) ------------------------------

_CALIBRATE = "TIERSAVE_IO_CALIBRATE"
_CALIBRATION_BYTES = "TIERSAVE_IO_CALIBRATION_BYTES"


def calibration_setting() -> Literal["on", "off", "refresh"]:
    """``TIERSAVE_IO_CALIBRATE``: ``1``/``on`` (default), ``0``/``off``, or ``refresh``."""
    raw = os.environ.get(_CALIBRATE, "").strip().lower()
    if raw in ("", "1", "on", "true", "yes"):
        return "on"
    if raw in ("0", "off", "false", "no"):
        return "off"
    if raw == "refresh":
        return "refresh"
    raise ConfigError(f"{_CALIBRATE}={raw!r} must be 1, 0 or refresh")


def calibration_bytes() -> int:
    """Bytes each path moves during a calibration (``TIERSAVE_IO_CALIBRATION_BYTES``, default 128 MiB)."""
    value = int_env(_CALIBRATION_BYTES, 128 << 20, 1 << 20, 1 << 34)
    if value % (1 << 20):
        raise ConfigError(f"{_CALIBRATION_BYTES}={value} is not a multiple of 1 MiB")
    return value


# -- the measurement and its cache ---------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """Throughput of each path on one file system, measured by :func:`calibrate`, in GB/s (1e9 B/s).

    Attributes:
        key: ``"major:minor:fstype"`` of the device and file system measured.
        direct_write_gbps: direct writes from aligned memory, then ``fsync``.
        buffered_write_gbps: buffered writes, then ``fsync``.
        direct_read_gbps: direct reads into aligned memory.
        buffered_read_gbps: buffered reads after evicting the file from the page cache.
        memcpy_gbps: one thread's memcpy (what a bounce buffer costs).
        nbytes: bytes moved per path per round.
        threads: concurrent requests.
        measured_at: Unix time of the measurement.
    """

    key: str
    direct_write_gbps: float
    buffered_write_gbps: float
    direct_read_gbps: float
    buffered_read_gbps: float
    memcpy_gbps: float
    nbytes: int
    threads: int
    measured_at: float
    version: int = _CALIBRATION_VERSION

    def direct_gbps(self, op: Literal["read", "write"], *, aligned: bool) -> float:
        """Expected direct throughput; an unaligned buffer adds one memcpy per byte (serial model)."""
        rate = self.direct_read_gbps if op == "read" else self.direct_write_gbps
        if aligned or rate <= 0 or self.memcpy_gbps <= 0:
            return rate
        return 1.0 / (1.0 / rate + 1.0 / self.memcpy_gbps)

    def buffered_gbps(self, op: Literal["read", "write"]) -> float:
        return self.buffered_read_gbps if op == "read" else self.buffered_write_gbps

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Calibration | None:
        """Parse a cached entry; None when it is malformed or of another version."""
        try:
            if not isinstance(data, dict) or data.get("version") != _CALIBRATION_VERSION:
                return None
            cal = cls(
                key=str(data["key"]),
                direct_write_gbps=float(data["direct_write_gbps"]),
                buffered_write_gbps=float(data["buffered_write_gbps"]),
                direct_read_gbps=float(data["direct_read_gbps"]),
                buffered_read_gbps=float(data["buffered_read_gbps"]),
                memcpy_gbps=float(data["memcpy_gbps"]),
                nbytes=int(data["nbytes"]),
                threads=int(data["threads"]),
                measured_at=float(data["measured_at"]),
            )
        except (KeyError, TypeError, ValueError):
            return None
        rates = (cal.direct_write_gbps, cal.buffered_write_gbps, cal.direct_read_gbps, cal.buffered_read_gbps)
        if not all(0 < r < 1e6 for r in rates):
            return None
        return cal


def fs_key(path: str | os.PathLike[str], fstype: str) -> str:
    """``"major:minor:fstype"`` of the file system holding ``path``: the calibration cache key."""
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}:{fstype or 'unknown'}"


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/tiersave/io-calibration.json`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiersave" / "io-calibration.json"


_CACHE_MAX_BYTES = 1 << 20  # a cache of any size this holds is far larger: a longer file is not one (ValueError)


def _load_cache() -> dict[str, Any]:
    try:
        data = json.loads(read_regular_file(cache_path(), _CACHE_MAX_BYTES).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store_cache(cal: Calibration) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_cache()
        data[cal.key] = cal.to_json()
        tmp = path.with_name(f".{path.name}.{new_token()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:  # a cache we cannot write only costs a calibration next time
        log.debug("could not write the I/O calibration cache %s: %s", path, exc)


def _fadvise_dontneed(fd: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def run_blocks(streams: int, nbytes: int, block: int, fn: Callable[[int, int], object]) -> float:
    """Call ``fn(offset, length)`` for every block of ``[0, nbytes)``: in order on this thread when
    ``streams`` is 1, else on a pool of ``streams`` threads taking blocks in order. Returns seconds."""
    offsets = [(off, min(block, nbytes - off)) for off in range(0, nbytes, block)]
    start = time.perf_counter()
    if streams == 1:
        for off, n in offsets:
            fn(off, n)
    else:
        with ThreadPoolExecutor(streams) as pool:
            for fut in [pool.submit(fn, off, n) for off, n in offsets]:
                fut.result()
    return time.perf_counter() - start


class ThreadBuffers:
    """One page-aligned buffer of ``nbytes`` per thread, allocated on first use (read targets)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._local = threading.local()

    def get(self, n: int) -> memoryview:
        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = aligned_buffer(self.nbytes)
        return buf[:n]


_PROBE_PREFIX = ".tiersave-calibrate-"


def _remove_orphan_probes(directory: str) -> None:
    """Delete probe files of calibrations whose process died midway (the pid is in the name)."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(_PROBE_PREFIX)]
    except OSError:
        return
    for name in names:
        pid_text = name[len(_PROBE_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))


def calibrate(
    directory: str | os.PathLike[str],
    *,
    fstype: str = "",
    nbytes: int | None = None,
    threads: int = 4,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    rounds: int = 2,
) -> Calibration | None:
    """Measure direct and buffered write+fsync and cold read in ``directory``; None if O_DIRECT is refused.

    Each round writes ``nbytes`` with each path from ``threads`` threads in ``block_bytes`` requests, then
    evicts the buffered file from the page cache and reads both back; the best round of each figure is
    kept (the disk is shared with other work, and a slow outlier says nothing about the path). The
    probe files are removed afterwards, and those left by a calibration whose process died are removed
    first.

    Raises:
        OSError: the directory cannot be written.
    """
    size = nbytes if nbytes is not None else calibration_bytes()
    size = max(block_bytes, size - size % block_bytes)
    base = os.fspath(directory)
    _remove_orphan_probes(base)
    key = fs_key(base, fstype)
    src = aligned_buffer(block_bytes)
    src[:] = (os.urandom(1 << 16) * (block_bytes // (1 << 16) + 1))[:block_bytes]  # incompressible
    best = {"dw": 0.0, "bw": 0.0, "dr": 0.0, "br": 0.0}
    bufs = ThreadBuffers(block_bytes)

    def write_gbps(fd: int) -> float:
        def one(off: int, n: int) -> int:
            return os.pwrite(fd, src[:n], off)

        t = run_blocks(threads, size, block_bytes, one)
        t0 = time.perf_counter()
        os.fsync(fd)
        return size / (t + time.perf_counter() - t0) / 1e9

    def read_gbps(fd: int) -> float:
        def one(off: int, n: int) -> int:
            return os.preadv(fd, [bufs.get(n)], off)

        return size / run_blocks(threads, size, block_bytes, one) / 1e9

    for _ in range(max(1, rounds)):
        dpath = os.path.join(base, f"{_PROBE_PREFIX}{os.getpid()}-{new_token()}.direct")
        bpath = os.path.join(base, f"{_PROBE_PREFIX}{os.getpid()}-{new_token()}.buffered")
        fds: list[int] = []
        try:
            fd = os.open(dpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            fds.append(fd)
            dfd = open_direct(dpath, os.O_WRONLY)
            if dfd is None:
                return None
            fds.append(dfd)
            best["dw"] = max(best["dw"], write_gbps(dfd))
            bfd = os.open(bpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            fds.append(bfd)
            best["bw"] = max(best["bw"], write_gbps(bfd))
            _fadvise_dontneed(bfd)
            _fadvise_dontneed(fd)
            rdfd = open_direct(dpath, os.O_RDONLY)
            if rdfd is None:
                return None
            fds.append(rdfd)
            best["dr"] = max(best["dr"], read_gbps(rdfd))
            rbfd = os.open(bpath, os.O_RDONLY)
            fds.append(rbfd)
            _fadvise_dontneed(rbfd)
            best["br"] = max(best["br"], read_gbps(rbfd))
        finally:
            for f in fds:
                os.close(f)
            for p in (dpath, bpath):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
    dst = aligned_buffer(block_bytes)
    t0 = time.perf_counter()
    for _ in range(4):
        ctypes.memmove(address_of(dst), address_of(src), block_bytes)
    memcpy = 4 * block_bytes / max(time.perf_counter() - t0, 1e-9) / 1e9
    cal = Calibration(
        key=key,
        direct_write_gbps=round(best["dw"], 4),
        buffered_write_gbps=round(best["bw"], 4),
        direct_read_gbps=round(best["dr"], 4),
        buffered_read_gbps=round(best["br"], 4),
        memcpy_gbps=round(memcpy, 3),
        nbytes=size,
        threads=threads,
        measured_at=time.time(),
    )
    log.info(
        "I/O calibration of %s (%s): write direct %.2f / buffered %.2f GB/s, read direct %.2f / buffered %.2f GB/s",
        base,
        key,
        cal.direct_write_gbps,
        cal.buffered_write_gbps,
        cal.direct_read_gbps,
        cal.buffered_read_gbps,
    )
    return cal


_memo: dict[str, Calibration | None] = {}
_memo_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}


def calibration_for(
    directory: str | os.PathLike[str], fstype: str, *, refresh: bool = False, measure: bool = True
) -> Calibration | None:
    """The calibration of the file system holding ``directory``: from this process, the disk cache, or
    measured now (at most once per file system per process; concurrent callers wait for it).

    Args:
        refresh: measure again even if a cached figure exists.
        measure: when nothing is cached, measure (False: return None instead).

    Returns:
        None when O_DIRECT is refused there, when the measurement failed, or when ``measure`` is False and
        nothing is cached.
    """
    try:
        key = fs_key(directory, fstype)
    except OSError:
        return None
    with _memo_lock:
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        if not refresh:
            with _memo_lock:
                if key in _memo:
                    return _memo[key]
            cached = Calibration.from_json(_load_cache().get(key))
            if cached is not None:
                with _memo_lock:
                    _memo[key] = cached
                return cached
        if not measure:
            return None
        try:
            cal = calibrate(directory, fstype=fstype)
        except OSError as exc:
            log.warning("I/O calibration in %s failed (%s); auto I/O uses its defaults", directory, exc)
            cal = None
        if cal is not None:
            _store_cache(cal)
        with _memo_lock:
            _memo[key] = cal
        return cal


def forget_calibrations() -> None:
    """Drop this process's memory of calibrations (the disk cache stays); for tests."""
    with _memo_lock:
        _memo.clear()
