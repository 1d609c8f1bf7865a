"""Ranged reads of one S3 object: :class:`S3BlobReader`.

Scope: ``read_into`` with bounds checks, splitting a read larger than ``read_part_bytes`` into parallel
ranged GETs on the storage's read pool, and detecting an object shorter than its listed size.
Anti-scope: owning the pool or the obstore client (``store.py`` does, and closes them), retries (obstore's),
checksums (the engine verifies CRC-32C).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import obstore
from obstore.store import S3Store

from ..._futures import wait_all
from ...errors import CorruptCheckpointError
from .errors import mapped_errors
from .options import S3Options
from .views import byte_view


class S3BlobReader:
    """Ranged reads of one object. A read larger than ``read_part_bytes`` is split into parallel GETs.

    Args:
        store: the obstore client of the storage that opened the reader.
        key: the object key relative to the storage root.
        size: the object's size, from the ``HEAD`` that opened the reader.
        options: the storage's options (``read_part_bytes``, and ``uri`` for messages).
        pool: returns the storage's read pool (created on first use, shut down by the storage).

    Thread safety: ``read_into`` may be called from many threads at once.
    """

    def __init__(
        self,
        store: S3Store,
        key: str,
        size: int,
        *,
        options: S3Options,
        pool: Callable[[], ThreadPoolExecutor],
    ) -> None:
        self.key = key
        self.size = size
        self._store = store
        self._uri = options.uri
        self._options = options
        self._step = options.read_part_bytes
        self._pool = pool

    def read_into(self, offset: int, out: memoryview) -> None:
        view = byte_view(out)
        end = offset + len(view)
        if offset < 0 or end > self.size:
            raise CorruptCheckpointError(
                f"{self.key!r} on {self._uri} ends at byte {self.size}, before byte {end}", file=self.key
            )
        step = self._step
        if len(view) <= step:
            self._fetch(offset, view)
            return
        pool = self._pool()
        futures: list[Future[None]] = [
            pool.submit(self._fetch, offset + start, view[start : start + step]) for start in range(0, len(view), step)
        ]
        wait_all(futures)

    def _fetch(self, offset: int, view: memoryview) -> None:
        if not view:
            return
        with mapped_errors(self._uri, "reading", self.key, self._options):
            data = obstore.get_range(self._store, self.key, start=offset, length=len(view))
        got = memoryview(data)
        if len(got) != len(view):
            raise CorruptCheckpointError(
                f"{self.key!r} on {self._uri}: bytes {offset}..{offset + len(view)} returned {len(got)} bytes "
                "(object shorter than expected or replaced)",
                file=self.key,
            )
        view[:] = got

    def close(self) -> None:
        pass

    def __enter__(self) -> S3BlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
