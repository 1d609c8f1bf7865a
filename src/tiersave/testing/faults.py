"""``FaultyStorage``: wrap any Storage and make chosen operations fail, for I/O-error tests.

Counts every operation (``put``, ``get``, ``open_writer``, ``write_at``, ``finish``, ``open_reader``,
``read_into``, ``rename_prefix``, ``delete_prefix``...) and raises the given error on the N-th call of a
chosen kind (SQLite's ioerr.test style), once or persistently. Everything else passes through to the
real backend, so the data that does get written is real.
"""

from __future__ import annotations

import builtins
import errno
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import storage_error_from_os
from ..storage.base import BlobReader, BlobWriter, ObjectInfo, PutMode, Storage


@dataclass
class Fault:
    """Fail the ``nth`` (1-based) call of operation ``op`` (``"*"``: any operation)."""

    op: str
    nth: int = 1
    error: Callable[[], BaseException] = field(default=lambda: OSError(errno.EIO, "injected I/O error"))
    persistent: bool = False  # keep failing every later call of ``op`` too


class FaultyStorage:
    """A Storage wrapper that injects faults; ``ops`` counts calls by operation name.

    Args:
        inner: the real backend.
        faults: errors to raise on chosen calls.
        delays: seconds to sleep before each call of an operation (a slow device).
        gates: operations that block until their ``threading.Event`` is set (deterministic slowness).
    """

    def __init__(
        self,
        inner: Storage,
        faults: list[Fault] | None = None,
        *,
        delays: dict[str, float] | None = None,
        gates: dict[str, threading.Event] | None = None,
    ) -> None:
        self.inner = inner
        self.uri = inner.uri
        self.capabilities = inner.capabilities
        self.faults = list(faults or [])
        self.delays = dict(delays or {})
        self.gates = dict(gates or {})
        self.ops: Counter[str] = Counter()
        self.total = 0
        self.log: list[str] = []
        self._lock = threading.Lock()

    def _tick(self, op: str, key: str) -> None:
        gate = self.gates.get(op)
        if gate is not None:
            gate.wait()
        delay = self.delays.get(op)
        if delay:
            time.sleep(delay)
        with self._lock:
            self.ops[op] += 1
            self.total += 1
            self.log.append(f"{op} {key}")
            for fault in self.faults:
                count = self.total if fault.op == "*" else self.ops[op] if fault.op == op else 0
                if count == fault.nth or (fault.persistent and count > fault.nth):
                    exc = fault.error()
                    break
            else:
                return
        if isinstance(exc, OSError):
            raise storage_error_from_os(exc, tier=self.uri, key=key, action=f"{op} (injected)")
        raise exc

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        self._tick("put", key)
        self.inner.put(key, data, mode=mode)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        self._tick("get", key)
        return self.inner.get(key, max_bytes=max_bytes)

    def open_reader(self, key: str) -> BlobReader:
        self._tick("open_reader", key)
        return _FaultyReader(self, self.inner.open_reader(key))

    def open_writer(self, key: str, *, size_hint: int | None = None) -> BlobWriter:
        self._tick("open_writer", key)
        return _FaultyWriter(self, self.inner.open_writer(key, size_hint=size_hint))

    def head(self, key: str) -> ObjectInfo:
        self._tick("head", key)
        return self.inner.head(key)

    def exists(self, key: str) -> bool:
        self._tick("exists", key)
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._tick("list", prefix)
        return self.inner.list(prefix)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        self._tick("list_dirs", prefix)
        return self.inner.list_dirs(prefix)

    def delete(self, key: str) -> None:
        self._tick("delete", key)
        self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self._tick("delete_prefix", prefix)
        self.inner.delete_prefix(prefix)

    def rename_prefix(self, src: str, dst: str) -> None:
        self._tick("rename_prefix", f"{src} -> {dst}")
        self.inner.rename_prefix(src, dst)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _FaultyWriter:
    def __init__(self, owner: FaultyStorage, inner: BlobWriter) -> None:
        self._owner, self._inner, self.key = owner, inner, inner.key

    def write_at(self, offset: int, data: memoryview) -> None:
        self._owner._tick("write_at", self.key)
        self._inner.write_at(offset, data)

    def finish(self, size: int) -> None:
        self._owner._tick("finish", self.key)
        self._inner.finish(size)

    def abort(self) -> None:
        self._inner.abort()

    def __getattr__(self, name: str) -> Any:  # the wrapped writer's other methods (interrupt)
        return getattr(self._inner, name)


class _FaultyReader:
    def __init__(self, owner: FaultyStorage, inner: BlobReader) -> None:
        self._owner, self._inner, self.key, self.size = owner, inner, inner.key, inner.size

    def read_into(self, offset: int, out: memoryview) -> None:
        self._owner._tick("read_into", self.key)
        self._inner.read_into(offset, out)

    def close(self) -> None:
        self._inner.close()
