"""The per-request I/O policy: direct or buffered, decided by size, alignment, file system and measurement.

Scope: the ``io="auto" | "direct" | "buffered"`` choice for each read or write the POSIX storage
issues, the knobs it reads (``TIERSAVE_IO``, ``TIERSAVE_DIRECT_MIN_BYTES``, ``TIERSAVE_BOUNCE_BYTES``),
and statistics of what each path moved and why. Anti-scope: measuring the file system
(:mod:`tiersave.storage.posix.calibration`), the system calls themselves
(:mod:`tiersave.storage.posix.directio`), durability (the storage ``fsync``-s), chunking and threads
(the engine's write pipeline and reader).

Decision rules of :meth:`IOPolicy.decide`, first match wins (``Decision.reason`` names the rule):

==================  ==========  ========================================================================
reason              path        when
==================  ==========  ========================================================================
``forced-buffered`` buffered    ``io="buffered"`` (or ``TIERSAVE_IO=buffered``)
``direct-refused``  buffered    the file system refused ``O_DIRECT`` (EINVAL on open, e.g. ramfs, some
                                FUSE and network file systems): fallback, never failure, even with
                                ``io="direct"``
``forced-direct``   direct      ``io="direct"`` (or ``TIERSAVE_IO=direct``), any size
``memory-fs``       buffered    auto on tmpfs/ramfs: the page cache *is* the storage, a direct I/O is a
                                plain copy with more system calls
``small``           buffered    auto, a *read* of fewer than ``TIERSAVE_DIRECT_MIN_BYTES`` (1 MiB): one
                                synchronous direct request per small tensor costs more than a read that
                                the kernel's read-ahead has often already fetched
``calibrated``      the faster  auto, by the cached calibration of this file system. Reads: direct
                                unless buffered is more than 5% faster, where an unaligned destination
                                charges direct with one memcpy through a bounce buffer. Writes: the
                                same comparison for aligned writes, whatever the size or alignment of
                                the request, so that one file is written one way (see below)
``uncalibrated``    direct      auto with calibration disabled or failed: on block devices buffered
                                write+fsync is the slow path (0.22 vs 2.0 GB/s measured here)
==================  ==========  ========================================================================

Why writes to one file never mix paths under auto: ext4 takes the inode lock exclusively for a buffered
write, so each small buffered write waits for the direct writes in flight on the same file and stalls
the ones queued behind it. Measured on a 1.5 GB save: 267 small tensors (48 MB) written buffered between
direct writes cost 1.7-2.4 thread-seconds, about as much as the 1.46 GB written direct. Small direct
writes into preallocated blocks run in parallel with the large ones instead.

The calibration (:mod:`tiersave.storage.posix.calibration`) is looked up on the first request that
needs it, or earlier by :meth:`IOPolicy.ensure_calibrated`.

Thread safety: :class:`IOPolicy` and :class:`IOStats` may be used from many threads at once.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ...errors import ConfigError
from ...knobs import int_env  # one parser for every TIERSAVE_* integer
from .calibration import Calibration, calibration_for, calibration_setting
from .directio import DEFAULT_BLOCK_BYTES

log = logging.getLogger(__name__)

__all__ = [
    "MEMORY_FS",
    "Decision",
    "IOMode",
    "IOPolicy",
    "IOStats",
    "PathStats",
    "bounce_bytes",
    "direct_min_bytes",
    "io_mode_from_env",
    "parse_io_mode",
]

IOPath = Literal["direct", "buffered"]

MEMORY_FS = frozenset({"tmpfs", "ramfs"})
"""File systems whose files live in the page cache: auto always reads and writes them buffered."""

_BUFFERED_MARGIN = 1.05  # buffered must beat direct by this factor to be chosen (direct spares the cache)


# -- knobs (TIERSAVE_* variables, read at call time as in tiersave.knobs) ------------------------------

_IO = "TIERSAVE_IO"
_DIRECT_MIN = "TIERSAVE_DIRECT_MIN_BYTES"
_BOUNCE = "TIERSAVE_BOUNCE_BYTES"


class IOMode(str, enum.Enum):
    """How a storage moves bytes: chosen per request (``auto``), or forced."""

    AUTO = "auto"
    DIRECT = "direct"
    BUFFERED = "buffered"

    def __str__(self) -> str:
        return self.value


def parse_io_mode(value: IOMode | str) -> IOMode:
    """``"auto"``, ``"direct"`` or ``"buffered"`` (any case) as an :class:`IOMode`.

    Raises:
        ConfigError: any other value.
    """
    if isinstance(value, IOMode):
        return value
    try:
        return IOMode(str(value).strip().lower())
    except ValueError:
        raise ConfigError(f"io must be one of auto, direct, buffered; got {value!r}") from None


def io_mode_from_env() -> IOMode:
    """The I/O mode from ``TIERSAVE_IO`` (default ``auto``)."""
    raw = os.environ.get(_IO, "")
    if not raw:
        return IOMode.AUTO
    try:
        return parse_io_mode(raw)
    except ConfigError:
        raise ConfigError(f"{_IO}={raw!r} must be one of auto, direct, buffered") from None


def direct_min_bytes() -> int:
    """Reads smaller than this go buffered under ``io="auto"`` (``TIERSAVE_DIRECT_MIN_BYTES``)."""
    return int_env(_DIRECT_MIN, 1 << 20, 0, 1 << 40)


def bounce_bytes() -> int:
    """Size of one bounce buffer (``TIERSAVE_BOUNCE_BYTES``), a multiple of 4096."""
    value = int_env(_BOUNCE, DEFAULT_BLOCK_BYTES, 4096, 1 << 30)
    if value % 4096:
        raise ConfigError(f"{_BOUNCE}={value} is not a multiple of 4096")
    return value


# -- statistics --------------------------------------------------------------------------------------


@dataclass
class PathStats:
    """Bytes, summed per-call seconds (thread-seconds, not wall time) and calls of one I/O path."""

    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0

    @property
    def gbps(self) -> float:
        """Bytes per thread-second, in GB/s (a per-thread rate: concurrent calls overlap)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def add(self, nbytes: int, seconds: float, calls: int = 1) -> None:
        self.bytes += nbytes
        self.seconds += seconds
        self.calls += calls


class IOStats:
    """What one writer, reader or storage moved on each path, and why each request took its path.

    Paths: ``direct`` (straight between the caller's memory and the disk), ``direct-bounce`` (direct
    I/O through a page-aligned bounce buffer), ``buffered`` (through the page cache), ``blocks`` (the
    unaligned edges of direct writes, merged into whole blocks and written at ``finish``). Apart from the
    paths, ``writeback``: the ranges of buffered writes whose writeback was started early
    (:mod:`~tiersave.storage.posix.writeback`; their bytes are also counted under ``buffered``).

    Thread safety: every method may be called from many threads.
    """

    PATHS = ("direct", "direct-bounce", "buffered", "blocks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.paths: dict[str, PathStats] = {p: PathStats() for p in self.PATHS}
        self.reasons: Counter[str] = Counter()
        self.writeback = PathStats()

    def record(self, path: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.paths.setdefault(path, PathStats()).add(nbytes, seconds)

    def record_writeback(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.writeback.add(nbytes, seconds)

    def note(self, reason: str) -> None:
        with self._lock:
            self.reasons[reason] += 1

    def merge(self, other: IOStats) -> None:
        """Add ``other``'s figures to this one."""
        with other._lock:
            paths = {k: PathStats(v.bytes, v.seconds, v.calls) for k, v in other.paths.items()}
            reasons = Counter(other.reasons)
            wb = PathStats(other.writeback.bytes, other.writeback.seconds, other.writeback.calls)
        with self._lock:
            self.writeback.add(wb.bytes, wb.seconds, wb.calls)
            for name, s in paths.items():
                self.paths.setdefault(name, PathStats()).add(s.bytes, s.seconds, s.calls)
            self.reasons.update(reasons)

    def copy(self) -> IOStats:
        out = IOStats()
        out.merge(self)
        return out

    def bytes_by_path(self) -> dict[str, int]:
        with self._lock:
            return {k: v.bytes for k, v in self.paths.items() if v.calls}

    def to_json(self) -> dict[str, Any]:
        """``{"paths": {path: {bytes, seconds, calls}}, "reasons": {reason: count}}`` (paths used only), and
        ``"writeback": {bytes, seconds, calls}`` when early writeback started any range."""
        with self._lock:
            wb = self.writeback
            early = {"writeback": {"bytes": wb.bytes, "seconds": round(wb.seconds, 6), "calls": wb.calls}}
            return {
                "paths": {
                    k: {"bytes": v.bytes, "seconds": round(v.seconds, 6), "calls": v.calls}
                    for k, v in self.paths.items()
                    if v.calls
                },
                "reasons": dict(sorted(self.reasons.items())),
                **(early if wb.calls else {}),
            }

    def __repr__(self) -> str:
        used = {k: v.bytes for k, v in self.paths.items() if v.calls}
        return f"IOStats({used}, reasons={dict(self.reasons)})"


# -- the policy --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Decision:
    """The path chosen for one request, the rule that chose it, and a sentence for the debug log."""

    path: IOPath
    reason: str
    detail: str = ""


@dataclass
class IOPolicy:
    """Chooses direct or buffered I/O per request for one storage root.

    Args:
        mode: ``auto``, ``direct`` or ``buffered``.
        root: the directory (used for calibration).
        fstype: the file-system type of ``root`` (``ext4``, ``tmpfs``...).
        min_direct_bytes: auto reads smaller requests buffered (default ``TIERSAVE_DIRECT_MIN_BYTES``).
        calibration: a fixed calibration (tests, benchmarks); None looks it up lazily on the first
            request that needs it, as ``TIERSAVE_IO_CALIBRATE`` says.

    Thread safety: ``decide`` and ``mark_refused`` may be called from many threads.
    """

    mode: IOMode
    root: Path
    fstype: str
    min_direct_bytes: int = field(default_factory=direct_min_bytes)
    calibration: Calibration | None = None
    refused: str = ""
    _looked_up: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.mode = parse_io_mode(self.mode)
        if self.calibration is not None:
            self._looked_up = True

    @property
    def memory_fs(self) -> bool:
        return self.fstype in MEMORY_FS

    def wants_direct(self) -> bool:
        """Whether writers and readers should open a direct descriptor at all."""
        if self.refused or self.mode is IOMode.BUFFERED:
            return False
        return self.mode is IOMode.DIRECT or not self.memory_fs

    def mark_refused(self, why: str) -> None:
        """Record that the file system refused O_DIRECT; every later request goes buffered."""
        with self._lock:
            if self.refused:
                return
            self.refused = why
        level = logging.WARNING if self.mode is IOMode.DIRECT else logging.INFO
        log.log(level, "O_DIRECT refused on %s (%s, %s): using buffered I/O", self.root, self.fstype, why)

    def ensure_calibrated(self) -> None:
        """Look up (or measure, per ``TIERSAVE_IO_CALIBRATE``) the calibration now rather than inside the
        first large request (``Checkpointer.prepare`` calls this before training starts)."""
        if self.mode is IOMode.AUTO and self.wants_direct():
            self._get_calibration()

    def _get_calibration(self) -> Calibration | None:
        if self._looked_up:
            return self.calibration
        setting = calibration_setting()
        cal = None
        if setting != "off":
            cal = calibration_for(self.root, self.fstype, refresh=setting == "refresh")
        with self._lock:
            if not self._looked_up:
                self.calibration, self._looked_up = cal, True
            return self.calibration

    def decide(self, op: Literal["read", "write"], nbytes: int, *, aligned: bool) -> Decision:
        """Choose the path of one request of ``nbytes`` whose buffer is (not) direct-I/O aligned."""
        if self.mode is IOMode.BUFFERED:
            return Decision("buffered", "forced-buffered", "io=buffered")
        if self.refused:
            return Decision("buffered", "direct-refused", f"O_DIRECT refused on {self.fstype}: {self.refused}")
        if self.mode is IOMode.DIRECT:
            return Decision("direct", "forced-direct", "io=direct")
        if self.memory_fs:
            return Decision("buffered", "memory-fs", f"{self.fstype} keeps files in memory")
        if op == "read" and nbytes < self.min_direct_bytes:
            return Decision("buffered", "small", f"{nbytes} B < {self.min_direct_bytes} B")
        cal = self._get_calibration()
        if cal is None:
            return Decision("direct", "uncalibrated", "no calibration: direct by default on a block device")
        if op == "write":
            aligned = True  # one path per file: the choice may not depend on the request (module docstring)
        direct = cal.direct_gbps(op, aligned=aligned)
        buffered = cal.buffered_gbps(op)
        detail = f"{op}: direct{'' if aligned else ' (bounce)'} {direct:.2f} GB/s vs buffered {buffered:.2f} GB/s"
        if buffered > direct * _BUFFERED_MARGIN:
            return Decision("buffered", "calibrated", detail)
        return Decision("direct", "calibrated", detail)
