"""``Tier(..., compress="auto")``: compress a tier's drains only where measured throughput says it pays.

Scope: the compressor's throughput and ratio on this machine (a short calibration on synthetic training
data, cached per host in ``$XDG_CACHE_HOME/tiersave/codec-calibration.json``), the tier's write throughput
(from its own past drains), and the choice for each drain, logged with its reason. Anti-scope: encoding
(engine/codec.py), copying (drain.py), when a drain runs (tiers.py).

The model: a drain of ``B`` bytes takes ``B / W`` plain (``W`` the tier's measured end-to-end drain
throughput) and about ``max(B / C, B / (r * W))`` compressed, the drain's threads compressing at ``C`` in
all while the smaller stream (ratio ``r``) is sent. Compressing pays when ``C`` exceeds ``W`` and ``r``
exceeds 1, each by a margin (:data:`MARGIN`, :data:`MIN_RATIO`). The first drain to a tier is sent plain,
which measures ``W``. Compressed drains then only raise ``W`` (their sent bytes per second are a lower bound
of what the tier takes), so a tier that turns out faster than the compressor goes back to plain drains.

Thread safety: a tier has one drain thread; :class:`AutoCompress` is called from it only. The calibration
runs at most once per process.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .drain import CopyResult
from .engine.codec import LEVEL, encode_frame, require_codec
from .storage.posix.safepath import read_regular_file

log = logging.getLogger(__name__)

__all__ = ["AutoCompress", "CodecCalibration", "codec_calibration"]

MARGIN = 1.2
"""Compress only when the compressor outpaces the tier by at least this factor."""
MIN_RATIO = 1.05
"""... and the data shrinks by at least this factor."""
_SAMPLE_BYTES = 8 << 20
_lock = threading.Lock()
_calibration: CodecCalibration | None = None


class CodecCalibration:
    """Single-thread zstd throughput (bytes/s of decoded input, split and CRC included) and ratio, measured
    on synthetic fp32 Adam moments and bf16 weights."""

    def __init__(self, bytes_per_s: float, ratio: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.ratio = ratio


_CACHE_MAX_BYTES = 1 << 20  # far more than the cache holds: a longer file is no cache (a JSON error)


def _positive(value: Any) -> bool:
    """A cached rate or ratio that can be used: a finite float above 0 (a damaged cache may read as NaN or inf)."""
    return isinstance(value, float) and 0 < value < float("inf")


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiersave" / "codec-calibration.json"


def _cache_key() -> str:
    import zstandard

    return f"{socket.gethostname()}:zstd-{zstandard.__version__}:level-{LEVEL}"


def _measure() -> CodecCalibration:
    rng = np.random.default_rng(0)
    n = _SAMPLE_BYTES // 4
    moments = rng.standard_normal(n, dtype=np.float32) * 1e-4
    weights = ((rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)  # bf16
    data = [(moments.view(np.uint8), 4), (weights.view(np.uint8), 2)]
    raw = stored = 0
    best = float("inf")
    for _ in range(2):  # best of two rounds: a busy moment must not turn compression off for good
        started = time.perf_counter()
        raw = stored = 0
        for array, width in data:
            packed, _ = encode_frame(memoryview(array.tobytes()), width)
            raw += array.nbytes
            stored += len(packed)
        best = min(best, time.perf_counter() - started)
    return CodecCalibration(raw / best, raw / max(1, stored))


def codec_calibration(*, refresh: bool = False) -> CodecCalibration:
    """This host's compressor figures: from this process, the cache file, or measured now (about 0.2 s)."""
    global _calibration
    with _lock:
        if _calibration is not None and not refresh:
            return _calibration
        path, key = _cache_path(), _cache_key()
        try:
            entry = json.loads(read_regular_file(path, _CACHE_MAX_BYTES).decode()).get(key) if not refresh else None
            if isinstance(entry, dict) and all(_positive(entry.get(k)) for k in ("bytes_per_s", "ratio")):
                _calibration = CodecCalibration(entry["bytes_per_s"], entry["ratio"])
                return _calibration
        except (OSError, ValueError, AttributeError):
            pass  # no usable cache: measure
        _calibration = _measure()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            doc: dict[str, Any] = (
                json.loads(read_regular_file(path, _CACHE_MAX_BYTES).decode()) if path.exists() else {}
            )
            doc[key] = {"bytes_per_s": _calibration.bytes_per_s, "ratio": _calibration.ratio, "time": time.time()}
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps(doc), encoding="utf-8")
            tmp.replace(path)
        except (OSError, ValueError) as exc:  # a cache we cannot write only costs a calibration next time
            log.debug("could not write the codec calibration cache %s: %s", path, exc)
        return _calibration


class AutoCompress:
    """The compress-or-not choice of one tier's drains.

    Args:
        tier: the tier's name, for the log.
        threads: the drain's worker threads (they compress in parallel).
    """

    def __init__(self, tier: str, threads: int) -> None:
        require_codec("zstd")
        self.tier = tier
        self.threads = threads
        self.write_bps: float | None = None
        self.ratio: float | None = None
        self.decision: tuple[str | None, str] = (None, "no drain yet")

    def choose(self) -> tuple[str | None, str]:
        """``(codec or None, reason)`` for the next drain."""
        if self.write_bps is None:
            return None, "no measured drain throughput for this tier yet: sending plain to measure it"
        cal = codec_calibration()
        speed = cal.bytes_per_s * self.threads
        ratio = self.ratio or cal.ratio
        figures = (
            f"compressor {speed / 1e6:.0f} MB/s on {self.threads} thread(s), ratio {ratio:.2f}, "
            f"tier {self.write_bps / 1e6:.0f} MB/s"
        )
        if speed >= MARGIN * self.write_bps and ratio >= MIN_RATIO:
            return "zstd", f"compressing is faster end to end ({figures})"
        return None, f"compressing would not be faster ({figures})"

    def drain(self, run: Callable[..., CopyResult]) -> CopyResult:
        """Run one drain (``run(compress=...)``) with the chosen codec and learn from its figures."""
        codec, reason = self.choose()
        if codec != self.decision[0] or self.decision[1] == "no drain yet":
            log.info("tier %s: drains %s: %s", self.tier, "compressed (zstd)" if codec else "plain", reason)
        self.decision = (codec, reason)
        result = run(compress=codec)
        if result.skipped or result.seconds <= 0 or result.file_bytes == 0:  # 0: an incremental drain referenced all
            return result
        sent_bps = result.file_bytes / result.seconds
        if codec is None:
            self.write_bps = sent_bps
        else:
            self.write_bps = max(self.write_bps or 0.0, sent_bps)
            self.ratio = result.stored_bytes / max(1, result.file_bytes)
        return result
