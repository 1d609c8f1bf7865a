"""What a benchmark run measures: :class:`BenchConfig`, shared by the runner, the multi-rank phase and the CLI.

Scope: the run's parameters and their validation. Anti-scope: running anything (:mod:`.runner`,
:mod:`.ranks`), the state's shapes (:mod:`.workload`), the report (:mod:`.report`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["IO_MODES", "BenchConfig"]

IO_MODES = ("auto", "direct", "buffered", "async")
"""Ways tiersave saves in the run: blocking saves with each I/O policy, and ``async`` (``save_async`` with the
auto policy: the caller's blocked time and the time until durable)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """What to run.

    Attributes:
        directory: where checkpoints go (on the file system under test); created, and emptied at the end
            unless ``keep``.
        model: a :mod:`tiersave.planner.architecture` preset whose shapes the state imitates.
        size_bytes: the state's size (weights + two Adam moments, fp32).
        checkpoints: timed rounds of save + load per method.
        warmup: untimed rounds first (a job's first save allocates what later saves reuse: staging
            memory, threads; the benchmark measures the steady state).
        io_modes: tiersave I/O modes to run (``auto``, ``direct``, ``buffered``, and ``async``: ``save_async``
            with the auto policy).
        peers: peer methods (``torch``, ``safetensors``, ``dcp``, ``dcp-async``) and yardsticks (``memcpy`` and
            ``dlrover-shm``: copies into shared memory; ``plain-write``: a buffered write + ``fsync``).
        io_threads: tiersave's I/O threads (None: its default).
        raw: measure the raw device limits.
        drop_caches: also drop the kernel page cache (root only) besides ``fadvise(DONTNEED)``.
        recalibrate: measure the auto policy's calibration again instead of using the cached one.
        ranks: processes of the multi-rank phase, one collective checkpoint per save (0: skip it).
        replicated: in the multi-rank phase, every rank holds the whole state, declared replicated (DDP)
            instead of a 1/N share of it.
        seed: seed of the state's random values.
        aligned_state: allocate every tensor of the state (and of the live state restored into; in every rank
            too) at a page boundary instead of where torch's allocator puts it (64 bytes past one): what a device whose
            direct I/O takes memory as torch lays it out (NVMe: 4-byte alignment) sees, on a device that
            demands more (this project's virtual disk: 512), so that writes and reads move the tensors in place.
        keep: leave the last checkpoints on disk.
    """

    directory: Path
    model: str = "llama3-8b"
    size_bytes: int = 3_000_000_000
    checkpoints: int = 3
    warmup: int = 1
    io_modes: tuple[str, ...] = IO_MODES
    peers: tuple[str, ...] = ("torch", "safetensors", "dcp", "dcp-async", "memcpy", "dlrover-shm", "plain-write")
    io_threads: int | None = None
    raw: bool = True
    drop_caches: bool = True
    recalibrate: bool = False
    ranks: int = 0
    replicated: bool = False
    seed: int = 0
    aligned_state: bool = False
    keep: bool = False

    def __post_init__(self) -> None:
        if self.checkpoints < 1:
            raise ConfigError(f"checkpoints must be >= 1, got {self.checkpoints}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.ranks < 0:
            raise ConfigError(f"ranks must be >= 0, got {self.ranks}")
        for mode in self.io_modes:
            if mode not in IO_MODES:
                raise ConfigError(f"unknown io mode {mode!r}; known: {', '.join(IO_MODES)}")
        if len(set(self.io_modes)) != len(self.io_modes) or len(set(self.peers)) != len(self.peers):
            raise ConfigError("io modes and peers must not repeat")

    def to_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "model": self.model,
            "size_bytes": self.size_bytes,
            "checkpoints": self.checkpoints,
            "warmup": self.warmup,
            "io_modes": list(self.io_modes),
            "peers": list(self.peers),
            "io_threads": self.io_threads,
            "raw": self.raw,
            "drop_caches": self.drop_caches,
            "recalibrate": self.recalibrate,
            "ranks": self.ranks,
            "replicated": self.replicated,
            "seed": self.seed,
            "aligned_state": self.aligned_state,
        }
