"""The contenders: tiersave in each I/O mode, and the peers, behind one save/load interface.

Every method saves the same flat state dict and is timed *until durable* (its files ``fsync``-ed: tiersave
and DCP do it themselves, ``torch.save`` and safetensors get an ``fsync`` of the file and its directory
inside the timed region, since a checkpoint that a power cut can lose is not a checkpoint). Loads are timed
from a cold page cache (the runner evicts before every timed operation) until the tensors are in memory:

- ``new``: the loader allocates the tensors (``torch.load``, safetensors ``load_file``,
  ``Checkpointer.restore(step)``);
- ``into``: the loader fills a preallocated state in place (DCP ``load``,
  ``Checkpointer.restore(step, into=state)``), as when a job resumes with its model already built.

Peers run with their defaults (DCP: one writer thread, ``sync_files=True``), which is what a user gets.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import BackendUnavailableError, ConfigError

__all__ = [
    "PEERS",
    "DCPAsyncMethod",
    "DCPMethod",
    "Method",
    "SafetensorsMethod",
    "SaveTiming",
    "TiersaveAsyncMethod",
    "TiersaveMethod",
    "TorchSaveMethod",
    "make_peer",
]

State = dict[str, torch.Tensor]

_WAIT_S = 3600.0  # the longest a benchmarked save may take before the run fails instead of hanging


@dataclass
class SaveTiming:
    """Seconds until durable, seconds the caller was blocked (less than ``seconds`` for async saves)."""

    seconds: float
    blocked_s: float
    stats: dict[str, Any] = field(default_factory=dict)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_file_save(save: Callable[[], object], path: Path) -> SaveTiming:
    """Time ``save()`` (which writes ``path``) plus the ``fsync`` of the file and of its directory."""
    start = time.perf_counter()
    save()
    _fsync_path(path)
    _fsync_path(path.parent)
    seconds = time.perf_counter() - start
    return SaveTiming(seconds, seconds)


class Method(ABC):
    """One way to save and load a checkpoint, timed by the runner.

    Call order: ``prepare(root)`` once; then per checkpoint ``save(i, state)``, ``load(i, variant,
    template)`` for each of ``load_variants``, ``remove(i)``; ``close()`` at the end. One thread.
    """

    name: str = ""
    family: str = "peer"
    load_variants: tuple[str, ...] = ("new",)

    def prepare(self, root: Path) -> None:
        self.root = root / self.name
        if self.root.exists():
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True)

    @abstractmethod
    def save(self, index: int, state: State) -> SaveTiming: ...

    @abstractmethod
    def load(self, index: int, variant: str, template: State) -> tuple[float, State]:
        """Seconds, and the loaded state (for a spot check outside the timed region)."""

    def paths(self, index: int) -> list[Path]:
        return [self.root]

    def remove(self, index: int) -> None:
        for p in self.root.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def close(self) -> None:
        return None


class TiersaveMethod(Method):
    """``Checkpointer.save`` (blocking: until committed and durable) and ``restore``, one I/O mode."""

    family = "tiersave"
    load_variants: tuple[str, ...] = ("new", "into")

    def __init__(self, io: str, *, io_threads: int | None = None, calibration: Any = None) -> None:
        self.io = io
        self.name = f"tiersave-{io}"
        self.io_threads = io_threads
        self.calibration = calibration
        self.ckpt: Any = None

    def prepare(self, root: Path) -> None:
        from ..checkpointer import Checkpointer
        from ..storage.posix import LocalStorage

        super().prepare(root)
        self.storage = LocalStorage(self.root, io=self.io, calibration=self.calibration)
        self.ckpt = Checkpointer(self.storage, io_threads=self.io_threads)

    def save(self, index: int, state: State) -> SaveTiming:
        before = self.storage.io_stats.copy()
        start = time.perf_counter()
        handle = self.ckpt.save(index + 1, state)
        seconds = time.perf_counter() - start
        stats = dict(handle.stats.to_json())
        stats["io"] = _io_delta(before, self.storage.io_stats)
        return SaveTiming(seconds, seconds, stats)

    def load(self, index: int, variant: str, template: State) -> tuple[float, State]:
        start = time.perf_counter()
        out = self.ckpt.restore(index + 1, into=template if variant == "into" else None)
        return time.perf_counter() - start, out

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()


class TiersaveAsyncMethod(Method):
    """``Checkpointer.save_async`` with the auto policy: the time the caller was blocked, and the time until
    the save is durable (``handle.result()``). It loads nothing: its restores would be ``tiersave-auto``'s."""

    name = "tiersave-async"
    family = "tiersave-async"
    load_variants: tuple[str, ...] = ()

    def __init__(self, *, io_threads: int | None = None, calibration: Any = None) -> None:
        self.inner = TiersaveMethod("auto", io_threads=io_threads, calibration=calibration)
        self.inner.name = self.name  # its own directory

    def prepare(self, root: Path) -> None:
        self.inner.prepare(root)
        self.root = self.inner.root

    def save(self, index: int, state: State) -> SaveTiming:
        start = time.perf_counter()
        handle = self.inner.ckpt.save_async(index + 1, state)
        blocked = time.perf_counter() - start
        handle.result(_WAIT_S)
        seconds = time.perf_counter() - start
        return SaveTiming(seconds, blocked, dict(handle.stats.to_json()))

    def load(self, index: int, variant: str, template: State) -> tuple[float, State]:
        raise ConfigError("tiersave-async checkpoints are loaded by tiersave-auto")

    def close(self) -> None:
        self.inner.close()


def _io_delta(before: Any, after: Any) -> dict[str, Any]:
    a, b = before.to_json(), after.to_json()
    paths = {}
    for name, s in b["paths"].items():
        prev = a["paths"].get(name, {"bytes": 0, "seconds": 0.0, "calls": 0})
        if s["bytes"] - prev["bytes"]:
            paths[name] = {"bytes": s["bytes"] - prev["bytes"], "seconds": round(s["seconds"] - prev["seconds"], 6)}
    reasons = {k: v - a["reasons"].get(k, 0) for k, v in b["reasons"].items() if v - a["reasons"].get(k, 0)}
    return {"paths": paths, "reasons": reasons}


class TorchSaveMethod(Method):
    """``torch.save`` + ``fsync``; ``torch.load(weights_only=True)``."""

    name = "torch"

    def _file(self, index: int) -> Path:
        return self.root / f"ckpt-{index}.pt"

    def save(self, index: int, state: State) -> SaveTiming:
        path = self._file(index)
        return _durable_file_save(lambda: torch.save(state, path), path)

    def load(self, index: int, variant: str, template: State) -> tuple[float, State]:
        start = time.perf_counter()
        out = torch.load(self._file(index), map_location="cpu", weights_only=True)
        return time.perf_counter() - start, out


class SafetensorsMethod(Method):
    """safetensors ``save_file`` + ``fsync``; ``load_file``."""

    name = "safetensors"

    def __init__(self) -> None:
        try:
            from safetensors.torch import load_file, save_file
        except ImportError:
            raise BackendUnavailableError(
                "the safetensors peer needs safetensors: pip install 'tiersave[bench]'"
            ) from None
        self._save_file, self._load_file = save_file, load_file

    def _file(self, index: int) -> Path:
        return self.root / f"ckpt-{index}.safetensors"

    def save(self, index: int, state: State) -> SaveTiming:
        path = self._file(index)
        return _durable_file_save(lambda: self._save_file(state, str(path)), path)

    def load(self, index: int, variant: str, template: State) -> tuple[float, State]:
        start = time.perf_counter()
        out: State = self._load_file(str(self._file(index)))
        return time.perf_counter() - start, out


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    # DCP warns on every call that it assumes one process, even with no_dist=True: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class DCPMethod(Method):
    """``torch.distributed.checkpoint.save``/``load`` in one process (``no_dist=True``, no process group)."""

    name = "dcp"
    load_variants: tuple[str, ...] = ("into",)

    def _dir(self, index: int) -> Path:
        return self.root / f"ckpt-{index}"

    def save(self, index: int, state: State) -> SaveTiming:
        from torch.distributed.checkpoint import state_dict_saver

        with single_process():
            start = time.perf_counter()
            state_dict_saver.save(state, checkpoint_id=self._dir(index), no_dist=True)
        seconds = time.perf_counter() - start
        return SaveTiming(seconds, seconds)

    def load(self, index: int, variant: str, template: State) -> tuple[float, State]:
        from torch.distributed.checkpoint import state_dict_loader

        with single_process():
            start = time.perf_counter()
            state_dict_loader.load(template, checkpoint_id=self._dir(index), no_dist=True)
        return time.perf_counter() - start, template


class DCPAsyncMethod(DCPMethod):
    """``torch.distributed.checkpoint.async_save`` (thread executor, no process group needed): blocked
    time until it returns, and the time until its future completes (files written and ``fsync``-ed).
    Its checkpoints have DCP's format, so loading is measured once, by :class:`DCPMethod`."""

    name = "dcp-async"
    load_variants: tuple[str, ...] = ()

    def save(self, index: int, state: State) -> SaveTiming:
        from torch.distributed.checkpoint import state_dict_saver

        with single_process():  # the warning comes from the background thread too
            start = time.perf_counter()
            response = state_dict_saver.async_save(state, checkpoint_id=self._dir(index), no_dist=True)
            blocked = time.perf_counter() - start
            if isinstance(response, state_dict_saver.AsyncSaveResponse):  # other stager types
                response.upload_completion.result()
            else:
                response.result()
        return SaveTiming(time.perf_counter() - start, blocked)

    def load(self, index: int, variant: str, template: State) -> tuple[float, State]:
        raise ConfigError("dcp-async checkpoints are loaded by the dcp method")


PEERS = ("torch", "safetensors", "dcp", "dcp-async")
"""The checkpointing peers; the copy and write yardsticks (``memcpy``, ``dlrover-shm``, ``plain-write``) are
in :mod:`.references` and are named in ``--peers`` too."""


def make_peer(name: str) -> Method:
    """A peer method by name (one of :data:`PEERS`).

    Raises:
        ConfigError: unknown name.
        BackendUnavailableError: its package is missing.
    """
    if name == "torch":
        return TorchSaveMethod()
    if name == "safetensors":
        return SafetensorsMethod()
    if name == "dcp":
        return DCPMethod()
    if name == "dcp-async":
        return DCPAsyncMethod()
    raise ConfigError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
