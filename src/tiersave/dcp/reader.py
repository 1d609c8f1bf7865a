"""``tiersave.dcp.Reader``: torch.distributed.checkpoint's ``StorageReader`` on tiersave storage.

Scope: find a committed step (the newest, or the one asked for), read and strictly validate its manifest
and the DCP metadata in it (no pickle), and serve DCP's read items: read only the checksum chunks that
cover each requested region, verify their CRC-32C before a byte reaches the caller, copy into the
destination (or read straight into it when the region is a whole stored chunk). Pickled non-tensor
items are checked, then handed to DCP under the ``unpickle`` policy.
Anti-scope: load planning and resharding (DCP's planners), tier fallback, the native restore path.

Call order (DCP's): ``reset`` (all ranks) -> ``read_metadata`` (all) -> ``set_up_storage_reader`` (all)
-> ``prepare_local_plan`` (all) -> ``prepare_global_plan`` (coordinator: checks that every rank reads
the same checkpoint) -> ``read_data`` (all).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future as PyFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..engine.codec import DecodingReader
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    FormatError,
    ObjectNotFoundError,
    StateMismatchError,
    UnsupportedStateError,
)
from ..format.checksum import crc32c_hex
from ..format.layout import MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_step_dirname, step_dirname
from ..format.manifest import Manifest
from ..leases import LeaseStore
from ..storage import open_storage
from ..storage.base import BlobReader, Storage
from . import metadata as dcpmeta
from ._common import aligned_empty, byte_view, check_checkpoint_id, check_step, check_threads, root_text

Unpickle = Literal["restricted", "trusted", "never"]
_UNPICKLE = ("restricted", "trusted", "never")


@dataclass(frozen=True)
class _Pick:
    """What each rank tells the coordinator (in ``LoadPlan.storage_data``): the checkpoint it resolved."""

    step: int
    fingerprint: str


class Reader(StorageReader):
    """Load with ``torch.distributed.checkpoint`` from a tiersave root, onto any world size.

    Example::

        import torch.distributed.checkpoint as dcp
        from tiersave.dcp import Reader

        state = {"model": model.state_dict()}
        dcp.load(state, storage_reader=Reader("s3://bucket/run1"))  # the newest committed step

    The constructor finds the step, reads its manifest and validates it and the DCP metadata in it
    (sizes, offsets, dtypes, chunk bounds): a damaged or hostile checkpoint raises a typed tiersave error
    right there. During ``dcp.load`` every byte is checked against its CRC-32C before it is handed to
    DCP; a mismatch fails the load with :class:`~tiersave.errors.CorruptCheckpointError` (DCP reports it
    as a ``CheckpointException`` whose ``failures`` map each rank to its error). On a failed load the
    destination tensors may be partly overwritten, as with any DCP reader.

    With ``step=None`` every rank resolves the newest step on its own; if a save commits in between,
    ranks could pick different steps: the coordinator detects that and fails the load with
    :class:`~tiersave.errors.DistributedCheckpointError`. Pass ``step`` explicitly when saves may run
    concurrently with the load.

    Args:
        root: a path, ``file://``, ``mem://NAME``, ``s3://bucket/prefix?options``, or a ``Storage``.
        step: the step to load; None for the newest committed one.
        unpickle: what to do with DCP's pickled non-tensor items (optimizer hyper-parameters, ints,
            strings), after their checksums passed. ``"restricted"`` (default): unpickle them with torch's
            restricted unpickler (``torch.load(weights_only=True)``), and hand DCP a fresh pickle of the
            result, so DCP's own unrestricted ``torch.load`` never sees stored bytes; objects of other
            types fail with :class:`~tiersave.errors.UnsupportedStateError` (allow more types with
            ``torch.serialization.add_safe_globals``). ``"trusted"``: hand the stored bytes to DCP, which
            unpickles them with ``weights_only=False`` (runs code from the checkpoint: only for
            checkpoints you trust). ``"never"``: fail on any pickled item (tensors-only loads).
        threads: I/O threads per rank.
        io: for a local root: ``"auto"``, ``"direct"`` or ``"buffered"``.

    Attributes:
        step: the step being loaded.
        manifest: its validated manifest.

    Raises:
        ConfigError: an invalid argument or URI.
        CheckpointNotFoundError: no committed checkpoint (or not ``step``) in ``root``.
        FormatError: the manifest or the DCP metadata is invalid, or the step was not saved through DCP.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        step: int | None = None,
        *,
        unpickle: Unpickle = "restricted",
        threads: int = 4,
        io: str | None = None,
    ) -> None:
        super().__init__()
        self._root = root_text(root)
        wanted = check_step(step, optional=True)
        if unpickle not in _UNPICKLE:
            raise ConfigError(f"unpickle must be one of {', '.join(map(repr, _UNPICKLE))}, got {unpickle!r}")
        self.unpickle: Unpickle = unpickle
        self.threads = check_threads(threads)
        self.storage: Storage = open_storage(root, create=False, io=io)
        self.step, self.manifest, self._fingerprint = _resolve(self.storage, wanted)
        self._decoded = dcpmeta.decode(self.manifest, where=self.checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self._rank = 0

    def __repr__(self) -> str:
        return f"tiersave.dcp.Reader({self.storage.uri!r}, step={self.step})"

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint being read: ``<root uri>/step-NNNNNNNNNN`` (informational; DCP logs it)."""
        return f"{self.storage.uri}/{step_dirname(self.step)}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Always False: DCP never picks tiersave by itself; pass ``storage_reader=Reader(...)``."""
        return False

    # -- DCP's call sequence --------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load; ``checkpoint_id`` may only repeat this reader's root (ConfigError otherwise)."""
        check_checkpoint_id(checkpoint_id, self._root, self.storage, "Reader")
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP asks for per-rank metadata only after the global read failed; there is none to fall back to.
            raise ConfigError(f"{self!r}: tiersave DCP checkpoints have one global metadata, no per-rank ones")
        md = self._decoded.metadata
        meta = md.storage_meta or StorageMeta()
        return dataclasses.replace(
            md,
            state_dict_metadata=dict(md.state_dict_metadata),
            storage_meta=dataclasses.replace(meta, modules=list(meta.modules), load_id=self.load_id),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._rank = int(kwargs.get("rank", 0) or 0)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=_Pick(self.step, self._fingerprint))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        picks = {rank: plan.storage_data for rank, plan in enumerate(plans)}
        if len(set(picks.values())) > 1:
            described = ", ".join(
                f"rank {r}: step {p.step}" if isinstance(p, _Pick) else f"rank {r}: {p!r}" for r, p in picks.items()
            )
            raise DistributedCheckpointError(
                f"ranks resolved different checkpoints in {self.storage.uri} ({described}); a save committed "
                "while they looked for the newest: pass step= to Reader so that every rank loads the same one"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # a read lease for the load (leases.py): another process's retention keeps the step until it ends
        lease = LeaseStore(self.storage).take(self.step, self.manifest.referenced_steps)
        try:
            _Load(self, planner).run(plan.items)
        finally:
            if lease is not None:
                lease.release()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- internals ------------------------------------------------------------------------------------

    def _location(self, item: ReadItem) -> dcpmeta.Location:
        loc = self._decoded.locations.get(item.storage_index)
        if loc is None:
            raise FormatError(
                f"{self.checkpoint_id} has no stored item {item.storage_index.fqn!r} at offsets "
                f"{list(item.storage_index.offset or ())}",
                path=self.checkpoint_id,
            )
        return loc


def _resolve(storage: Storage, step: int | None) -> tuple[int, Manifest, str]:
    """The step to load, its parsed manifest and a fingerprint of the manifest's bytes."""
    if step is not None:
        candidates = [step]
    else:
        candidates = sorted(
            (s for s in (parse_step_dirname(n) for n in storage.list_dirs("")) if s is not None), reverse=True
        )
    for candidate in candidates:
        key = f"{step_dirname(candidate)}/{MANIFEST_NAME}"
        try:
            data = storage.get(key, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            continue  # not committed (an object store keeps step-N/ for in-progress attempts)
        manifest = Manifest.parse(data, path=f"{storage.uri}/{key}", expect_step=candidate)
        return candidate, manifest, crc32c_hex(data)
    if step is not None:
        raise CheckpointNotFoundError(f"step {step} is not committed in {storage.uri}")
    raise CheckpointNotFoundError(f"no committed checkpoint in {storage.uri}")


class _ItemRead:
    """One read item in flight: its chunk reads, then a finishing step on the calling thread."""

    def __init__(self, remaining: int, done: Callable[[], None]) -> None:
        self.remaining = remaining
        self.done = done


class _Load:
    """Executes one rank's load plan: parallel chunk reads with checksums, DCP callbacks in order."""

    def __init__(self, reader: Reader, planner: LoadPlanner | None) -> None:
        self.reader = reader
        self._planner = planner
        self.manifest = reader.manifest
        self.cb = reader.manifest.chunk_bytes
        self._blobs: dict[int, BlobReader] = {}
        self._lock = threading.Lock()

    def run(self, items: list[ReadItem]) -> None:
        window = 2 * self.reader.threads
        pending: deque[tuple[PyFuture[None], _ItemRead]] = deque()
        try:
            with ThreadPoolExecutor(self.reader.threads, thread_name_prefix="tiersave-dcp-read") as pool:
                try:
                    for item in items:
                        jobs, state = self._plan(item)
                        if not jobs:
                            state.done()
                        for job in jobs:
                            pending.append((pool.submit(job), state))
                            while len(pending) >= window:
                                _collect(pending.popleft())
                    while pending:
                        _collect(pending.popleft())
                except BaseException:
                    for fut, _ in pending:
                        fut.cancel()
                    raise
        finally:
            self.close()

    @property
    def planner(self) -> LoadPlanner:
        assert self._planner is not None, "a load plan needs DCP's planner"
        return self._planner

    def read_whole(self, loc: dcpmeta.Location) -> torch.Tensor:
        """One stored item as a tensor of its dtype and shape, every checksum verified (for export; the
        caller closes this object when done)."""
        self._blob(loc.entry.shard)  # real length checked before allocating
        buf = aligned_empty(loc.entry.nbytes)
        jobs = self._chunk_jobs(loc, 0, loc.entry.nbytes, byte_view(buf), keep=buf)
        with ThreadPoolExecutor(self.reader.threads, thread_name_prefix="tiersave-dcp-read") as pool:
            for fut in [pool.submit(job) for job in jobs]:
                fut.result()
        return buf.view(loc.dtype).reshape(loc.sizes)

    def close(self) -> None:
        with self._lock:
            blobs, self._blobs = list(self._blobs.values()), {}
        for blob in blobs:
            blob.close()

    # -- planning one item ----------------------------------------------------------------------------

    def _plan(self, item: ReadItem) -> tuple[list[Callable[[], None]], _ItemRead]:
        loc = self.reader._location(item)
        # Open the shard (checking its real length against the manifest) before allocating anything the
        # manifest's sizes ask for: a forged size cannot make us allocate more than the shard holds.
        self._blob(loc.entry.shard)
        if item.type == LoadItemType.BYTE_IO:
            buf = bytearray(loc.entry.nbytes)
            jobs = self._chunk_jobs(loc, 0, loc.entry.nbytes, memoryview(buf))
            return jobs, _ItemRead(len(jobs), lambda: self._finish_bytes(item, bytes(buf)))
        target = self.planner.resolve_tensor(item).detach()
        lengths = tuple(item.lengths)
        if tuple(target.shape) != lengths:
            raise StateMismatchError(
                f"{self.reader.checkpoint_id}: {item.dest_index.fqn!r} expects a region of {list(lengths)}, "
                f"the destination is {list(target.shape)}"
            )
        if math.prod(lengths) == 0:
            return [], _ItemRead(0, lambda: self.planner.commit_tensor(item, target))
        whole = all(o == 0 for o in item.storage_offsets) and lengths == loc.sizes
        if whole and target.device.type == "cpu" and target.dtype == loc.dtype and target.is_contiguous():
            # The region is the whole stored chunk: read it straight into the destination's memory.
            jobs = self._chunk_jobs(loc, 0, loc.entry.nbytes, byte_view(target), keep=target)
            return jobs, _ItemRead(len(jobs), lambda: self.planner.commit_tensor(item, target))
        return self._region(item, loc, target)

    def _region(
        self, item: ReadItem, loc: dcpmeta.Location, target: torch.Tensor
    ) -> tuple[list[Callable[[], None]], _ItemRead]:
        """Read the checksum chunks covering a sub-region of a stored chunk, then copy the region out."""
        itemsize = loc.entry.nbytes // max(math.prod(loc.sizes), 1)
        strides = _contiguous_strides(loc.sizes)
        first = sum(o * s for o, s in zip(item.storage_offsets, strides, strict=True))
        last = sum((o + n - 1) * s for o, n, s in zip(item.storage_offsets, item.lengths, strides, strict=True))
        lo = first * itemsize // self.cb * self.cb
        hi = min(-(-(last + 1) * itemsize // self.cb) * self.cb, loc.entry.nbytes)
        buf = aligned_empty(hi - lo)
        jobs = self._chunk_jobs(loc, lo, hi, byte_view(buf), keep=buf)

        def done() -> None:
            flat = buf.view(loc.dtype)
            src = flat[first - lo // itemsize :].as_strided(tuple(item.lengths), strides)
            target.copy_(src)
            self.planner.commit_tensor(item, target)

        return jobs, _ItemRead(len(jobs), done)

    def _chunk_jobs(
        self, loc: dcpmeta.Location, lo: int, hi: int, out: memoryview, *, keep: object = None
    ) -> list[Callable[[], None]]:
        """One job per checksum chunk of ``[lo, hi)`` (chunk-aligned) of the stored item, into ``out``."""
        entry = loc.entry
        jobs: list[Callable[[], None]] = []
        for index in range(lo // self.cb, -(-hi // self.cb)):
            start = index * self.cb
            end = min(start + self.cb, entry.nbytes)

            def job(index: int = index, start: int = start, end: int = end) -> None:
                piece = out[start - lo : end - lo]
                self._blob(entry.shard).read_into(entry.offset + start, piece)
                if crc32c_hex(piece) != entry.crc32c[index]:
                    self._corrupt(entry.shard, entry.name, index, start, end)

            jobs.append(_bind(job, keep))
        return jobs

    def _blob(self, shard: int) -> BlobReader:
        blob = self._blobs.get(shard)
        if blob is not None:
            return blob
        with self._lock:
            blob = self._blobs.get(shard)
            if blob is None:
                info = self.manifest.shards[shard]
                key = info.key(step_dirname(self.reader.step))
                blob = self.reader.storage.open_reader(key)
                if info.encoding is not None:  # a compressed drain: decoded offsets, each frame checked first
                    where = f"{self.reader.checkpoint_id}, step {self.reader.step}"
                    blob = DecodingReader(blob, info.encoding, where=where, step=self.reader.step, file=info.file)
                if blob.size != info.size:
                    blob.close()
                    raise CorruptCheckpointError(
                        f"{self.reader.storage.uri}/{key} is {blob.size} bytes, the manifest says {info.size}",
                        path=self.reader.checkpoint_id,
                        step=self.reader.step,
                        file=info.file,
                    )
                self._blobs[shard] = blob
        return blob

    def _corrupt(self, shard: int, tensor: str, index: int, start: int, end: int) -> None:
        file = self.manifest.shards[shard].file
        raise CorruptCheckpointError(
            f"{self.reader.checkpoint_id}/{file}: checksum mismatch in {tensor!r}, chunk {index} "
            f"(bytes [{start}, {end}) of the tensor): the stored data is corrupt",
            path=self.reader.checkpoint_id,
            step=self.reader.step,
            file=file,
            tensor=tensor,
        )

    # -- pickled items ----------------------------------------------------------------------------------

    def _finish_bytes(self, item: ReadItem, data: bytes) -> None:
        fqn = item.dest_index.fqn
        policy = self.reader.unpickle
        if policy == "trusted":
            stream = io.BytesIO(data)
        elif policy == "never":
            raise UnsupportedStateError(
                f"{self.reader.checkpoint_id}: {fqn!r} is a pickled object and this Reader has "
                "unpickle='never'; use unpickle='restricted' to load it with torch's restricted unpickler",
                path=fqn,
            )
        else:
            try:
                obj = torch.load(io.BytesIO(data), weights_only=True)
            except Exception as exc:
                raise UnsupportedStateError(
                    f"{self.reader.checkpoint_id}: {fqn!r} holds a pickle that torch's restricted unpickler "
                    f"refuses ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Allow "
                    "its types with torch.serialization.add_safe_globals, or, only for a checkpoint you trust, "
                    "Reader(..., unpickle='trusted')",
                    path=fqn,
                ) from None
            # DCP's planner unpickles with weights_only=False: give it our own pickle of the vetted object,
            # never the stored bytes.
            stream = io.BytesIO()
            torch.save(obj, stream)
            stream.seek(0)
        self.planner.load_bytes(item, stream)


def _bind(job: Callable[[], None], keep: object) -> Callable[[], None]:
    def bound() -> None:
        _ = keep  # the buffer (or destination tensor) that the job's view points into stays referenced
        job()

    return bound


def _collect(entry: tuple[PyFuture[None], _ItemRead]) -> None:
    fut, state = entry
    fut.result()
    state.remaining -= 1
    if state.remaining == 0:
        state.done()


def _contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
