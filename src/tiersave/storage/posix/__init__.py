"""The POSIX backend: checkpoints in a directory of a local or shared file system, ``file:///path``.

Scope: :class:`LocalStorage` (the :class:`~tiersave.storage.base.Storage` protocol on files, with
atomic rename and ``fsync``), and beside it everything only this backend needs: direct I/O
(:mod:`.directio`), the per-request direct/buffered policy and its calibration (:mod:`.policy`),
and page-aligned buffers (:mod:`.buffers`).
Anti-scope: what a checkpoint contains or when it becomes visible (the checkpoint level), moving
tensor bytes between a state and a storage (``tiersave.engine``), the memory tier built on this
backend (:mod:`tiersave.storage.memory`).
"""

from __future__ import annotations

from .blobs import LocalBlobReader, LocalBlobWriter
from .files import filesystem_type
from .local import LocalStorage

__all__ = ["LocalBlobReader", "LocalBlobWriter", "LocalStorage", "filesystem_type"]
