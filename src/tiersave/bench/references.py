"""The yardsticks a save is held against that are not checkpointers: copies into memory and a plain write.

- ``memcpy``: one ``memcpy(3)`` per tensor into a preallocated, touched shared-memory buffer: the floor of
  any save that copies the state before returning (an async save's stall).
- ``dlrover-shm``: the same copy with ``Tensor.copy_`` into tensors laid out in that buffer, which is what
  DLRover's flash checkpoint does when it saves into memory; an async save should block no longer.
- ``plain-write``: the state's bytes written with plain buffered ``write(2)`` calls into one file, then the
  file and its directory ``fsync``-ed: the least a buffered checkpoint can do to be durable, so
  ``io="buffered"`` saves are held against it.

The two copies share one buffer: a file in ``/dev/shm`` (or ``TIERSAVE_SHM_DIR``), mapped at the first save and
unlinked at once (nothing is left behind if the run is killed), unmapped at ``close``; they report only a
blocked time (nothing is durable, nothing is loaded).

Scope: these three timings. Anti-scope: tiersave and the checkpointing peers (:mod:`.methods`), running and
reporting (:mod:`.runner`, :mod:`.report`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from .methods import Method, SaveTiming, State, _durable_file_save

__all__ = ["REFERENCES", "SharedBuffer", "make_reference"]

REFERENCES = ("memcpy", "dlrover-shm", "plain-write")


class SharedBuffer:
    """One shared-memory file mapped once, sized and laid out for the state at the first :meth:`views`."""

    def __init__(self) -> None:
        self._mm: mmap.mmap | None = None
        self._views: list[torch.Tensor] = []
        self._users = 0

    def acquire(self) -> None:
        self._users += 1

    def views(self, state: State) -> list[torch.Tensor]:
        """Tensors in the buffer, one per tensor of ``state``, same dtype and shape (touched once)."""
        if self._mm is None:
            self._map(state)
        return self._views

    def _map(self, state: State) -> None:
        nbytes = sum(t.nbytes for t in state.values())
        directory = os.environ.get("TIERSAVE_SHM_DIR", "/dev/shm")
        try:
            fd, name = tempfile.mkstemp(dir=directory, prefix="tiersave-bench-shm-")
        except OSError as exc:
            raise ConfigError(f"benchmark: cannot create the shared-memory buffer in {directory}: {exc}") from exc
        try:
            os.unlink(name)  # the mapping keeps the memory; nothing is left behind if the run is killed
            try:
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            except OSError as exc:
                raise ConfigError(
                    f"benchmark: {directory} cannot hold the {nbytes / 1e9:.2f} GB copy references: {exc}; "
                    "leave memcpy and dlrover-shm out of --peers or use a smaller --size"
                ) from exc
            self._mm = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        flat.fill_(1)  # touched: the reference is a steady-state copy, not page faults
        off = 0
        for t in state.values():
            self._views.append(flat[off : off + t.nbytes].view(t.dtype).view(t.shape))
            off += t.nbytes

    def release(self) -> None:
        self._users -= 1
        if self._users > 0:
            return
        self._views = []
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still exported: the mapping goes when the process does
                pass
            self._mm = None


class _CopyMethod(Method):
    family = "reference"
    load_variants: tuple[str, ...] = ()

    def __init__(self, buffer: SharedBuffer) -> None:
        self.buffer = buffer
        buffer.acquire()

    def paths(self, index: int) -> list[Path]:
        return []

    def remove(self, index: int) -> None:
        return None

    def load(self, index: int, variant: str, template: State) -> tuple[float, State]:
        raise ConfigError(f"{self.name} is a copy reference: nothing to load")

    def close(self) -> None:
        self.buffer.release()

    def save(self, index: int, state: State) -> SaveTiming:
        views = self.buffer.views(state)
        start = time.perf_counter()
        self._copy(views, list(state.values()))
        seconds = time.perf_counter() - start
        return SaveTiming(seconds, seconds)

    def _copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        raise NotImplementedError


class MemcpyMethod(_CopyMethod):
    """``memcpy(3)`` of every tensor into the shared-memory buffer, on the caller's thread."""

    name = "memcpy"

    def _copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        for d, s in zip(dst, src):
            ctypes.memmove(d.data_ptr(), s.data_ptr(), s.nbytes)


class DLRoverShmMethod(_CopyMethod):
    """``Tensor.copy_`` of every tensor into the shared-memory buffer, as DLRover's memory save copies."""

    name = "dlrover-shm"

    def _copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        for d, s in zip(dst, src):
            d.copy_(s)


class PlainWriteMethod(Method):
    """Plain buffered ``write(2)`` calls of every tensor's bytes into one file, then ``fsync`` of the file
    and its directory (timed); the file is removed outside the timed region."""

    name = "plain-write"
    family = "reference"
    load_variants: tuple[str, ...] = ()

    def save(self, index: int, state: State) -> SaveTiming:
        path = self.root / f"plain-{index}.bin"
        return _durable_file_save(lambda: _write_plain(path, state), path)

    def load(self, index: int, variant: str, template: State) -> tuple[float, State]:
        raise ConfigError("plain-write is a write reference: nothing to load")


def _write_plain(path: Path, state: State) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        for t in state.values():
            src = t.detach().contiguous()  # the state's tensors are; a copy otherwise, held while written
            view = memoryview((ctypes.c_char * src.nbytes).from_address(src.data_ptr())).cast("B")
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def make_reference(name: str, buffer: SharedBuffer) -> Method:
    """A reference by name (one of :data:`REFERENCES`); the copies share ``buffer``.

    Raises:
        ConfigError: unknown name.
    """
    if name == "memcpy":
        return MemcpyMethod(buffer)
    if name == "dlrover-shm":
        return DLRoverShmMethod(buffer)
    if name == "plain-write":
        return PlainWriteMethod()
    raise ConfigError(f"unknown reference {name!r}; known: {', '.join(REFERENCES)}")
