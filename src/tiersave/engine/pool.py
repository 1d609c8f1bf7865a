"""A thread pool of daemon threads, so that exiting the interpreter never hangs on a stuck write.

``concurrent.futures.ThreadPoolExecutor`` joins its (non-daemon) workers at interpreter exit without a
time limit; a write stuck on a dead network file system would then hang the exit. tiersave instead waits
for in-flight saves itself, with a bounded grace period (see ``Checkpointer.close`` and the exit hook),
and reports a save that did not finish.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from ..errors import ClosedError

T = TypeVar("T")

_STOP = object()


class DaemonThreadPool(Executor):
    """A fixed-size pool of daemon worker threads. ``submit`` is thread-safe."""

    def __init__(self, workers: int, name: str) -> None:
        self._name = name
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._shutdown = False
        # reentrant: a SIGTERM handler on the main thread may submit while that thread is inside submit()
        self._lock = threading.RLock()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def workers(self) -> int:
        return len(self._threads)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._shutdown:
                raise ClosedError(f"cannot submit to the thread pool {self._name!r}: it was shut down")
            fut: Future[T] = Future()
            self._queue.put((fut, fn, args, kwargs))
            return fut

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                del item, fut, fn, args, kwargs
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # delivered to whoever waits on the future
                fut.set_exception(exc)
            else:
                fut.set_result(result)
                del result
            # An idle worker would otherwise hold its last task until the next one arrives: a finished save's
            # write job, and through it the caller's tensors (what concurrent.futures fixed as gh-60488).
            del item, fut, fn, args, kwargs

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False, timeout: float | None = None) -> None:
        with self._lock:
            if self._shutdown:
                return
            self._shutdown = True
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    item[0].cancel()
        for _ in self._threads:
            self._queue.put(_STOP)
        if wait:
            for t in self._threads:
                t.join(timeout)
