"""The POSIX backend: checkpoints in a directory of a local or shared file system, ``file:///path``.

Scope: :class:`LocalStorage` (the :class:`~tiersave.storage.base.Storage` protocol on files, with
atomic rename and ``fsync``) and, beside it, everything only this backend needs:

- ``local``: :class:`LocalStorage`, whole objects, listing, deletion, the committing rename;
- ``blobs``: the blob writer and reader, direct or buffered per request;
- ``files``: system-call helpers (directory ``fsync``, rename without replacing, mount type, errors);
- ``directio``: the mechanics of ``O_DIRECT`` (alignment, bounce buffers, merged edges, refusal);
- ``writeback``: buffered writes' writeback started early (``sync_file_range``), the final ``fsync`` unchanged;
- ``policy``: the per-request direct/buffered choice, its knobs and statistics;
- ``calibration``: the once-per-file-system measurement that feeds the policy, and its cache;
- ``buffers``: page-aligned host buffers.

Anti-scope: what a checkpoint contains or when it becomes visible (the checkpoint level), moving
tensor bytes between a state and a storage (``tiersave.engine``), the memory tier built on this
backend (:mod:`tiersave.storage.memory`).
"""

from __future__ import annotations

from .blobs import LocalBlobReader, LocalBlobWriter
from .files import filesystem_type
from .local import LocalStorage

__all__ = ["LocalBlobReader", "LocalBlobWriter", "LocalStorage", "filesystem_type"]
