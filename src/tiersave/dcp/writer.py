"""``tiersave.dcp.Writer``: torch.distributed.checkpoint's ``StorageWriter`` on tiersave storage.

Scope: one DCP save = one tiersave checkpoint of one step, committed with tiersave's protocol
(``tiersave.commit``): the coordinator begins the attempt while planning, every rank writes one shard
file of its own (4 KiB-aligned tensors, CRC-32C per chunk) under the attempt's prefix, and the
coordinator's ``finish`` writes the manifest (DCP's metadata as JSON in its tree) and commits.
Anti-scope: planning, deduplication and resharding (DCP's planners do those), the native
``Checkpointer`` save path, retention.

Call order (DCP's, see ``torch.distributed.checkpoint.storage.StorageWriter``): ``reset`` (all ranks) ->
``set_up_storage_writer`` (all) -> ``prepare_local_plan`` (all) -> ``prepare_global_plan``
(coordinator: begins the attempt) -> ``write_data`` (all) -> ``finish`` (coordinator: commit).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import uuid
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future as PyFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..commit import commit_for
from ..errors import ConfigError, ObjectNotFoundError, SaveError, UnsupportedStateError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.dtypes import lookup
from ..format.jsonsafe import dumps_canonical, is_finite_number
from ..format.layout import DEFAULT_CHUNK_BYTES, align_up, is_valid_tag, shard_filename, step_dirname
from ..format.manifest import Manifest, ShardInfo, TensorEntry
from ..storage import open_storage
from ..storage.base import BlobWriter, Storage
from . import metadata as dcpmeta
from ._common import byte_view, check_checkpoint_id, check_chunk_bytes, check_step, check_threads, root_text

log = logging.getLogger(__name__)

_MAX_NAME = 1024
# The version DCP's own FileSystemWriter stamps on its metadata.
_DCP_VERSION: str = getattr(_dcp_fs, "CURRENT_DCP_VERSION", dcpmeta.DEFAULT_DCP_VERSION)


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank (in ``SavePlan.storage_data``): where its shard goes."""

    step: int
    prefix: str
    rank: int
    shard_key: str
    shard_file: str


@dataclass(frozen=True)
class _Stored:
    """Where one item's bytes were written (in ``WriteResult.storage_data``, gathered by the coordinator)."""

    prefix: str
    shard_key: str
    shard_file: str
    rank: int
    shard_size: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    crc32c: tuple[str, ...]


class Writer(StorageWriter):
    """Save with ``torch.distributed.checkpoint`` into a tiersave root, as one committed step.

    Example::

        import torch.distributed.checkpoint as dcp
        from tiersave.dcp import Writer

        dcp.save({"model": model.state_dict()}, storage_writer=Writer("s3://bucket/run1", step=100))

    Every rank passes a ``Writer`` for the same root and step. The checkpoint becomes visible (in
    ``tiersave ls``, to :class:`tiersave.dcp.Reader`) only when the coordinator's ``finish`` commits it; a
    save that fails or is killed before that leaves nothing visible (the attempt's files are removed by
    :meth:`abort`, by a retry with the same writer, or by ``tiersave prune``). A committed step is never
    overwritten: saving a step that exists fails with :class:`~tiersave.errors.AlreadyExistsError`.

    The root must be one place that every rank reaches: a shared file system, ``s3://``, or for a job on
    one node a local path or ``mem://NAME``.

    Args:
        root: a path, ``file://``, ``mem://NAME``, ``s3://bucket/prefix?options``, or a ``Storage``.
        step: the step to save, 0 <= step < 2**63.
        chunk_bytes: bytes per CRC-32C checksum chunk (a multiple of 4096, at most 64 MiB).
        threads: I/O threads per rank (checksums and writes overlap across them).
        metrics: finite numbers recorded in the manifest (for keep-best retention).
        tags: names recorded in the manifest.
        metadata: free JSON recorded in the manifest.
        io: for a local root: ``"auto"``, ``"direct"`` or ``"buffered"`` (None: ``TIERSAVE_IO``, else auto).

    Raises:
        ConfigError: an invalid argument or URI (before any I/O).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        step: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        threads: int = 4,
        metrics: Mapping[str, float] | None = None,
        tags: Sequence[str] = (),
        metadata: Mapping[str, Any] | None = None,
        io: str | None = None,
    ) -> None:
        super().__init__()
        self._root = root_text(root)
        self.step: int = check_step(step)  # type: ignore[assignment]
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        self.threads = check_threads(threads)
        self.metrics = _check_metrics(metrics)
        self.tags = _check_tags(tags)
        self.metadata = _check_metadata(metadata)
        # Kept to reopen the storage in another process (DCP's process-based async_save pickles the writer).
        self._reopen: tuple[str, str | None] | None = None if isinstance(root, Storage) else (os.fspath(root), io)
        self.storage: Storage = open_storage(root, io=io)
        self._commit = commit_for(self.storage)
        self.save_id = uuid.uuid4().hex
        self._is_coordinator = False
        self._rank = 0
        self._pending: str | None = None  # coordinator: the attempt begun and not yet committed or aborted

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for ``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``:
        the storage is reopened from its root in the receiving process."""
        if self._reopen is None:
            raise ConfigError(
                f"{self!r} was made from a Storage object and cannot be sent to another process; give "
                "Writer the root as a path or URI to use DCP's process-based async_save"
            )
        if self._pending is not None:
            raise SaveError(f"{self!r} cannot be sent to another process in the middle of a save")
        state = dict(self.__dict__)
        del state["storage"], state["_commit"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        assert self._reopen is not None
        root, io = self._reopen
        self.storage = open_storage(root, io=io)
        self._commit = commit_for(self.storage)

    def __repr__(self) -> str:
        return f"tiersave.dcp.Writer({self.storage.uri!r}, step={self.step})"

    @property
    def checkpoint_id(self) -> str:
        """Where this save goes: ``<root uri>/step-NNNNNNNNNN`` (informational; DCP logs it)."""
        return f"{self.storage.uri}/{step_dirname(self.step)}"

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Always False: DCP never picks tiersave by itself; pass ``storage_writer=Writer(...)``."""
        return False

    # -- DCP's call sequence --------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; ``checkpoint_id`` may only repeat this writer's root (ConfigError otherwise)."""
        check_checkpoint_id(checkpoint_id, self._root, self.storage, "Writer")
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError(
                "tiersave.dcp.Writer needs use_collectives=True: one checkpoint is committed once, by the "
                "coordinator, after every rank wrote its shard"
            )
        self._is_coordinator = is_coordinator
        self._rank = int(kwargs.get("rank", 0) or 0)
        if self._pending is not None:  # a previous save with this writer failed before finish: retrying
            self.abort()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Refuse unstorable dtypes on every rank before the coordinator begins an attempt.
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                _tensor_dtype(item)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        prefix = self._commit.begin(self.step)  # AlreadyExistsError if the step is committed
        self._pending = prefix
        out = []
        for rank, plan in enumerate(plans):
            name = shard_filename(rank, 0)
            info = _RankPlan(self.step, prefix, rank, f"{prefix}/{name}", self._commit.shard_file(prefix, name))
            out.append(dataclasses.replace(plan, storage_data=info))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, _RankPlan) or info.step != self.step:
            raise ConfigError(
                f"{self!r} got a plan for {getattr(info, 'step', info)!r}: it was not made by this save's "
                "coordinator (DCP plan caching, enable_plan_caching=True, is not supported)"
            )
        results = _ShardWrite(self, info, planner).run(plan.items)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write the manifest and commit. On failure the attempt is removed and nothing is
        visible.

        Raises:
            AlreadyExistsError: another writer committed this step first.
            SaveError: the ranks' results do not match DCP's metadata.
            UnsupportedStateError: the metadata holds a value JSON cannot represent.
        """
        prefix = self._pending
        if prefix is None:
            raise SaveError(f"{self!r}: finish without a begun save (is this rank the coordinator?)")
        try:
            metadata.version = _DCP_VERSION
            if metadata.storage_meta is None:
                metadata.storage_meta = self.storage_meta()
            manifest, keys = self._manifest(metadata, results, prefix)
            data = manifest.to_json()
            self._check_shards_visible(manifest, keys)
            self._commit.commit(prefix, self.step, data)
        except BaseException:
            self.abort()
            raise
        self._pending = None
        log.info("%s: committed %d tensors from %d ranks", self, len(manifest.tensors), manifest.world_size)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    # -- tiersave's own -----------------------------------------------------------------------------

    def abort(self) -> None:
        """Remove the files of a save this writer began and did not commit (a no-op on other ranks or
        after a commit). DCP has no abort hook: call this after a failed ``dcp.save`` to free the space
        now rather than at the next ``tiersave prune``."""
        prefix, self._pending = self._pending, None
        if prefix is None:
            return
        try:
            self._commit.abort(prefix)
        except Exception as exc:  # the original failure matters more; prune removes the rest
            log.warning("%s: could not remove the failed attempt %s: %s", self, prefix, exc)

    def _check_shards_visible(self, manifest: Manifest, keys: Mapping[str, str]) -> None:
        """Every rank's shard must be where the coordinator commits: this catches a root that is not shared
        (each node writing to its own local disk) before a checkpoint with missing shards is published."""

        def check(shard: ShardInfo) -> None:
            key = keys[shard.file]
            try:
                size = self.storage.head(key).size
            except ObjectNotFoundError:
                raise SaveError(
                    f"{self!r}: the shard of rank {shard.rank} ({key}) is not visible from the coordinator; "
                    "is the root one place that every rank reaches (shared file system, S3)?"
                ) from None
            if size != shard.size:
                raise SaveError(f"{self!r}: shard {key} is {size} bytes, rank {shard.rank} wrote {shard.size}")

        with ThreadPoolExecutor(min(16, max(1, len(manifest.shards)))) as pool:
            list(pool.map(check, manifest.shards))

    def _manifest(
        self, metadata: Metadata, results: list[list[WriteResult]], prefix: str
    ) -> tuple[Manifest, dict[str, str]]:
        stored: dict[MetadataIndex, _Stored] = {}
        for rank_results in results:
            for wr in rank_results:
                if not isinstance(wr.storage_data, _Stored):
                    raise SaveError(f"{self!r}: a rank returned a write result tiersave did not make")
                if wr.storage_data.prefix != prefix:
                    raise SaveError(
                        f"{self!r}: a rank wrote under {wr.storage_data.prefix}, not this attempt's {prefix} "
                        "(DCP plan caching is not supported)"
                    )
                if wr.index in stored:
                    raise SaveError(f"{self!r}: {wr.index.fqn!r} at {wr.index.offset} was written twice")
                stored[wr.index] = wr.storage_data
        names: dict[MetadataIndex, str] = {}
        tensors: dict[str, TensorEntry] = {}
        shards: dict[str, ShardInfo] = {}
        shard_keys: dict[str, str] = {}
        order: dict[str, int] = {}
        for fqn, item in metadata.state_dict_metadata.items():
            if isinstance(item, BytesStorageMetadata):
                keys = [(MetadataIndex(fqn), fqn)]
            else:
                whole = len(item.chunks) == 1 and item.chunks[0].sizes == item.size
                keys = [
                    (
                        MetadataIndex(fqn, c.offsets),
                        dcpmeta.chunk_name(fqn, tuple(c.offsets), tuple(c.sizes), whole),
                    )
                    for c in item.chunks
                ]
            for index, wanted in keys:
                rec = stored.pop(index, None)
                if rec is None:
                    raise SaveError(f"{self!r}: no rank wrote {fqn!r} at offsets {index.offset}")
                name = _unique_name(wanted, tensors, fqn)
                names[index] = name
                shard = shards.setdefault(rec.shard_file, ShardInfo(rec.shard_file, rec.rank, rec.shard_size))
                shard_keys[rec.shard_file] = rec.shard_key
                shard_index = order.setdefault(rec.shard_file, len(order))
                tensors[name] = TensorEntry(name, rec.dtype, rec.shape, shard_index, rec.offset, rec.nbytes, rec.crc32c)
                if shard.size != rec.shard_size or shard.rank != rec.rank:
                    raise SaveError(f"{self!r}: inconsistent sizes reported for shard {rec.shard_file}")
        if stored:
            extra = next(iter(stored))
            raise SaveError(f"{self!r}: {extra.fqn!r} was written but is not in DCP's metadata")
        manifest = Manifest(
            step=self.step,
            shards=tuple(shards.values()),
            tensors=tensors,
            tree={dcpmeta.TREE_KEY: dcpmeta.encode(metadata, names)},
            world_size=max(len(results), 1),
            chunk_bytes=self.chunk_bytes,
            metrics=self.metrics,
            tags=self.tags,
            metadata=self.metadata,
            stats={"writer": "tiersave.dcp", "save_id": self.save_id, "bytes": sum(t.nbytes for t in tensors.values())},
        )
        manifest.validate(path=self.checkpoint_id)
        return manifest, shard_keys


class _ShardWrite:
    """One rank's shard: lay the items out, resolve them one by one, checksum and write them in parallel."""

    def __init__(self, writer: Writer, info: _RankPlan, planner: SavePlanner) -> None:
        self.writer = writer
        self.info = info
        self.planner = planner
        self.chunk_bytes = writer.chunk_bytes

    def run(self, items: list[WriteItem]) -> list[WriteResult]:
        if not items:
            return []
        # Pickled items first: their length is known only once the planner has serialized them.
        pickled: dict[int, bytes] = {}
        for i, item in enumerate(items):
            if item.type == WriteItemType.BYTE_IO:
                pickled[i] = _pickled_bytes(self.planner.resolve_data(item), item)
        layout: list[tuple[int, int]] = []  # (offset, nbytes) per item
        pos = 0
        for i, item in enumerate(items):
            nbytes = len(pickled[i]) if i in pickled else _tensor_nbytes(item)
            offset = align_up(pos)
            layout.append((offset, nbytes))
            pos = offset + nbytes
        size = align_up(pos)
        blob = self.writer.storage.open_writer(self.info.shard_key)
        try:
            crcs = self._write_all(blob, items, layout, pickled)
            blob.finish(size)
        except BaseException:
            blob.abort()
            raise
        results = []
        for item, (offset, nbytes), sums in zip(items, layout, crcs, strict=True):
            shape: tuple[int, ...]
            if item.type == WriteItemType.BYTE_IO:
                dtype, shape = "uint8", (nbytes,)
            else:
                td = item.tensor_data
                assert td is not None  # checked by _tensor_dtype
                dtype, shape = _tensor_dtype(item), tuple(td.chunk.sizes)
            info = self.info
            stored = _Stored(
                info.prefix, info.shard_key, info.shard_file, info.rank, size, offset, nbytes, dtype, shape, tuple(sums)
            )
            results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=stored))
        return results

    def _write_all(
        self, blob: BlobWriter, items: list[WriteItem], layout: list[tuple[int, int]], pickled: dict[int, bytes]
    ) -> list[list[str]]:
        crcs: list[list[str]] = [[] for _ in items]
        window = 2 * self.writer.threads
        with ThreadPoolExecutor(self.writer.threads, thread_name_prefix="tiersave-dcp-write") as pool:
            # Each entry holds the tensor its bytes view points into, so that a copy (.cpu(), .contiguous())
            # lives exactly as long as its writes are in flight.
            pending: deque[tuple[int, int, PyFuture[str], object]] = deque()
            try:
                for i, item in enumerate(items):
                    offset, nbytes = layout[i]
                    owner: object = pickled[i] if i in pickled else self._tensor(item)
                    view = memoryview(owner) if isinstance(owner, bytes) else byte_view(owner)  # type: ignore[arg-type]
                    for k, (start, length) in enumerate(chunk_ranges(nbytes, self.chunk_bytes)):
                        piece = view[start : start + length]
                        pending.append((i, k, pool.submit(_put_chunk, blob, offset + start, piece), owner))
                        while len(pending) >= window:
                            _collect(pending.popleft(), crcs)
                while pending:
                    _collect(pending.popleft(), crcs)
            except BaseException:
                for entry in pending:
                    entry[2].cancel()
                raise
        return crcs

    def _tensor(self, item: WriteItem) -> torch.Tensor:
        td = item.tensor_data
        assert td is not None
        obj = self.planner.resolve_data(item)
        if not isinstance(obj, torch.Tensor):
            raise SaveError(f"DCP resolved tensor item {item.index.fqn!r} to a {type(obj).__name__}")
        tensor = obj.detach()
        if tensor.dtype != td.properties.dtype or tuple(tensor.shape) != tuple(td.chunk.sizes):
            raise SaveError(
                f"DCP resolved {item.index.fqn!r} to {tensor.dtype}{list(tensor.shape)}, planned as "
                f"{td.properties.dtype}{list(td.chunk.sizes)}"
            )
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        return tensor


def _put_chunk(blob: BlobWriter, offset: int, piece: memoryview) -> str:
    crc = crc32c_hex(piece)  # before the write: the bytes checksummed are the bytes written
    blob.write_at(offset, piece)
    return crc


def _collect(entry: tuple[int, int, PyFuture[str], object], crcs: list[list[str]]) -> None:
    i, k, fut, _ = entry
    crc = fut.result()
    assert len(crcs[i]) == k
    crcs[i].append(crc)


def _pickled_bytes(obj: Any, item: WriteItem) -> bytes:
    if isinstance(obj, io.BytesIO):
        return obj.getvalue()
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj)
    raise SaveError(f"DCP resolved the non-tensor item {item.index.fqn!r} to a {type(obj).__name__}, not bytes")


def _tensor_dtype(item: WriteItem) -> str:
    td = item.tensor_data
    if td is None:
        raise SaveError(f"DCP tensor item {item.index.fqn!r} carries no tensor description")
    name = dcpmeta.dtype_name(td.properties.dtype)
    if name is None:
        raise UnsupportedStateError(
            f"tensor {item.index.fqn!r} has dtype {td.properties.dtype}, which the tiersave format cannot store",
            path=item.index.fqn,
        )
    return name


def _tensor_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None
    info = lookup(_tensor_dtype(item))
    assert info is not None
    n = info.itemsize
    for s in td.chunk.sizes:
        n *= s
    return n


def _unique_name(wanted: str, taken: Mapping[str, Any], fqn: str) -> str:
    if not wanted or len(wanted) > _MAX_NAME or "\x00" in wanted:
        raise UnsupportedStateError(
            f"state dict key {fqn[:80]!r} is empty, longer than {_MAX_NAME} characters or holds NUL", path=fqn
        )
    name, n = wanted, 0
    while name in taken:  # an FQN that happens to look like another tensor's chunk name
        n += 1
        name = f"{wanted}#{n}"
    return name


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    out = dict(metrics or {})
    for key, value in out.items():
        if not isinstance(key, str) or not is_finite_number(value):
            raise ConfigError(f"metrics must map names to finite numbers, got {key!r}: {value!r}")
    return out


def _check_tags(tags: Iterable[str]) -> tuple[str, ...]:
    if isinstance(tags, str):
        raise ConfigError(f"tags must be a sequence of names, not the string {tags!r}")
    out = tuple(tags)
    for tag in out:
        if not isinstance(tag, str) or not is_valid_tag(tag):
            raise ConfigError(f"tag {tag!r} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}")
    if len(set(out)) != len(out):
        raise ConfigError(f"tags must be unique, got {list(out)}")
    return out


def _check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    out = dict(metadata or {})
    try:
        dumps_canonical(out)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"metadata must be plain JSON (finite numbers, str keys): {exc}") from None
    return out
