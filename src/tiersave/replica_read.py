"""Restore straight from a peer's replica: after the loss of its node, a rank's bytes stream from the holder's
memory into the destination tensors, each chunk checked once, as it lands, against its CRC-32C.

:class:`PeerCheckpoint` is an :class:`~tiersave.catalog.OpenCheckpoint` whose shard readers are ranged
requests to the holder's replica server (``replica.PeerClient.read_range``: one connection per chunk, so the
restore's reader threads pull several chunks at once, each received with ``recv_into`` into the tensor's own
memory). The usual reader (engine/reader.py) verifies every chunk, so the restore is one pass over the
network and one CRC per byte, where pulling the part into memory first and restoring from there was two
copies and two CRCs.

The node gets its memory tier back afterwards, in the background (``replication.Replicas.read``): writing
the copy during the restore, from the same bytes, was measured to halve the restore's speed (tmpfs pages
allocated, zeroed and copied on the restore's own threads), so the restore does not wait for it.

Fail closed: a chunk that does not match its CRC, a short or stalled stream, a malformed manifest fail this
holder; the next holder is tried, and when none is left the restore falls back (restore.py) as before.

Scope: the streamed read from a holder, the fallback from one holder to the next. Anti-scope: placement, the wire
and the server (replica.py, replication.py), choosing the step and the tier (restore.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

from .catalog import OpenCheckpoint
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .format.layout import MANIFEST_NAME, MAX_MANIFEST_BYTES, step_dirname
from .format.manifest import Manifest
from .replica import PeerClient, is_copy_error
from .storage.base import BlobReader, Storage
from .storage.posix.buffers import address_of

__all__ = ["PeerCheckpoint", "read_from_holders"]

T = TypeVar("T")

_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL and the pages fault in one by one
_PREFAULT_MIN = 1 << 20


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def _prefault(view: memoryview) -> None:
    """Fault in the pages of ``view`` with one call before the socket copies into it: a restore into new
    tensors otherwise takes one page fault per 4 KiB inside ``recv_into``, which was measured to cost more
    than the copy itself. An optimisation only: if the kernel refuses, the pages fault in as usual."""
    madvise = _madvise()
    if madvise is None or len(view) < _PREFAULT_MIN:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = address_of(view)
    first = (start + page - 1) // page * page
    last = (start + len(view)) // page * page
    if last > first:
        madvise(first, last - first, _MADV_POPULATE_WRITE)


class _PeerReader:
    """One shard on a holder, read by ranges straight into the caller's memory."""

    def __init__(self, client: PeerClient, ns: str, key: str, size: int) -> None:
        self.key = key
        self.size = size
        self._client = client
        self._ns = ns

    def read_into(self, offset: int, out: memoryview) -> None:
        view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
        if offset + len(view) > self.size:
            raise CorruptCheckpointError(f"{self.key}: a read past its {self.size} bytes", file=self.key)
        if view:
            _prefault(view)
            self._client.read_range(self._ns, self.key, self.size, offset, view)

    def close(self) -> None:
        pass


class PeerCheckpoint(OpenCheckpoint):
    """Step ``manifest.step`` as held by a peer (namespace ``ns`` of ``client``), opened for reading.

    Args:
        local: the memory tier this copy stands in for (its URI names the location in reports).
        manifest: the manifest read from the holder (parsed and validated).
        client: the holder's replica server.
        ns: the namespace there (``node-<n>``: the replica of node n).
    """

    def __init__(self, local: Storage, manifest: Manifest, client: PeerClient, ns: str) -> None:
        super().__init__(local, manifest, step_dirname(manifest.step))
        self.client = client
        self.ns = ns

    @property
    def location(self) -> str:
        return f"{self.storage.uri.rstrip('/')}/{self.prefix} (node {self.client.peer.node}'s replica)"

    def _open(self, shard: int) -> BlobReader:
        info = self.manifest.shards[shard]
        if info.step is not None or info.encoding is not None:
            raise CorruptCheckpointError(
                f"step {self.step}: shard {info.file} on {self.client.peer} is "
                f"{'referenced' if info.step is not None else 'compressed'}: a replica holds plain shards only",
                step=self.step,
                file=info.file,
            )
        return _PeerReader(self.client, self.ns, f"{self.prefix}/{info.file}", info.size)


def read_from_holders(
    clients: Sequence[PeerClient], ns: str, step: int, local: Storage, read: Callable[[OpenCheckpoint], T]
) -> tuple[T, PeerClient]:
    """``read`` step ``step`` from the first holder in ``clients`` whose copy works: its manifest fetched and
    validated, its bytes streamed (``read`` runs the restore over a :class:`PeerCheckpoint`).

    Returns:
        ``read``'s result and the holder it came from.

    Raises:
        CheckpointNotFoundError: no holder has a usable copy; the message names each and why.
    """
    reasons: list[str] = []
    for client in clients:
        where = f"step {step} from {client.peer} ({ns})"
        try:
            data = client.get(ns, f"{step_dirname(step)}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
            manifest = Manifest.parse(data, path=where, expect_step=step)
            with PeerCheckpoint(local, manifest, client, ns) as ckpt:
                return read(ckpt), client
        except Exception as exc:
            if not is_copy_error(exc):
                raise
            reasons.append(f"node {client.peer.node}: {exc}")
    raise CheckpointNotFoundError(f"step {step}: no peer holds a valid replica: " + ("; ".join(reasons) or "none"))
