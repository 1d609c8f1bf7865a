"""The committed checkpoints of one storage root: list, describe, open for reading, verify, delete.

Scope: what is committed under one root and what each checkpoint says (parsed, validated manifests, cached
per step), opening one for reading with its shards checked, verifying every byte, deleting what a retention
policy does not keep and the leftovers of interrupted saves. Anti-scope: how a checkpoint becomes visible
(commit.py), which root is which tier and when to prune (tiers.py), what to keep (policy.py), loading bytes
into a live state (restore.py).

Torch-free, so the CLI can list, inspect, verify and export checkpoints on any machine.
Thread safety: every method may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from . import knobs
from .commit import committed_steps, owner_alive
from .engine.codec import DecodingReader
from .engine.reader import ReadRequest, read_tensors
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    ObjectNotFoundError,
    TiersaveError,
)
from .format.checksum import chunk_ranges
from .format.layout import MANIFEST_NAME, MAX_MANIFEST_BYTES, is_leftover, parse_step_dirname, step_dirname
from .format.manifest import Manifest, TensorEntry
from .format.view import RankPart
from .leases import LeaseStore, ReadLease, Reclaim, delete_committed
from .policy import KeepLast, RetentionPolicy, plan_retention
from .references import Pins, unneeded
from .storage.base import BlobReader, Storage
from .tags import TagStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as listed.

    Attributes:
        step: training step.
        location: URI of the checkpoint directory or prefix.
        created_at: RFC 3339 commit time.
        tags: user tags (``best``, ``milestone``...): the manifest's, then the movable tags pointing here.
        metrics: user metrics (loss...).
        num_tensors: tensors stored.
        tensor_bytes: bytes of tensor data.
        stored_bytes: bytes on storage (shards with alignment padding, without the manifest).
        world_size: ranks that wrote it.
        stats: save statistics recorded by the writer.
    """

    step: int
    location: str
    created_at: str
    tags: tuple[str, ...]
    metrics: dict[str, float]
    num_tensors: int
    tensor_bytes: int
    stored_bytes: int
    world_size: int
    stats: dict[str, Any] = field(default_factory=dict)
    tiers: tuple[str, ...] = ()

    @classmethod
    def from_manifest(cls, m: Manifest, location: str) -> CheckpointInfo:
        return cls(
            step=m.step,
            location=location,
            created_at=m.created_at,
            tags=tuple(m.tags),
            metrics=dict(m.metrics),
            num_tensors=len(m.tensors),
            tensor_bytes=m.total_bytes,
            stored_bytes=m.stored_bytes,
            world_size=m.world_size,
            stats=dict(m.stats),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "location": self.location,
            "created_at": self.created_at,
            "tags": list(self.tags),
            "metrics": self.metrics,
            "num_tensors": self.num_tensors,
            "tensor_bytes": self.tensor_bytes,
            "stored_bytes": self.stored_bytes,
            "world_size": self.world_size,
            "tiers": list(self.tiers),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CheckpointInfo:
        """The inverse of :meth:`to_json` (plus ``stats`` when present), for an info sent between ranks."""
        return cls(
            step=int(doc["step"]),
            location=str(doc["location"]),
            created_at=str(doc["created_at"]),
            tags=tuple(doc["tags"]),
            metrics=dict(doc["metrics"]),
            num_tensors=int(doc["num_tensors"]),
            tensor_bytes=int(doc["tensor_bytes"]),
            stored_bytes=int(doc["stored_bytes"]),
            world_size=int(doc["world_size"]),
            stats=dict(doc.get("stats", {})),
            tiers=tuple(doc.get("tiers", ())),
        )


@dataclass
class VerifyReport:
    """Result of reading every byte of one checkpoint against its checksums."""

    step: int
    ok: bool
    bytes_checked: int
    seconds: float
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 6)}


@dataclass
class PruneResult:
    """What a prune deleted (or, in a dry run, would delete) and kept."""

    deleted: list[int]
    kept: list[int]
    leftovers_removed: list[str]
    live_saves: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class OpenCheckpoint:
    """A committed checkpoint opened for reading: its manifest and lazily opened shard readers.

    Opening a shard checks that its length equals the manifest's declared size, which rejects
    truncated, extended and swapped-in foreign shards before any byte is used.
    """

    def __init__(self, storage: Storage, manifest: Manifest, prefix: str, lease: ReadLease | None = None) -> None:
        self.storage = storage
        self.manifest = manifest
        self.prefix = prefix
        self.lease = lease  # released by close(): until then another process's retention keeps the step
        self._readers: dict[int, BlobReader] = {}
        self._lock = threading.Lock()
        self.shared: frozenset[int] = frozenset()  # shards other processes of this machine read now too

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def location(self) -> str:
        return f"{self.storage.uri.rstrip('/')}/{self.prefix}"

    def reader(self, shard: int) -> BlobReader:
        with self._lock:
            reader = self._readers.get(shard)
            if reader is None:
                reader = self._readers[shard] = self._open(shard)
            return reader

    def _open(self, shard: int) -> BlobReader:
        """A reader of shard ``shard``, its size checked against the manifest (:meth:`reader` caches it)."""
        info = self.manifest.shards[shard]
        key = info.key(self.prefix)
        held = f" (referenced in step {info.step})" if info.step is not None else ""
        try:
            shared = getattr(self.storage, "open_shared_reader", None) if shard in self.shared else None
            reader = (shared or self.storage.open_reader)(key)
        except ObjectNotFoundError:
            where = self.storage.uri.rstrip("/") + "/" + key.rsplit("/", 1)[0] if held else self.location
            raise CorruptCheckpointError(
                f"step {self.step}: shard {info.file}{held} is missing from {where}",
                step=self.step,
                file=info.file,
            ) from None
        if info.encoding is not None:  # serves decoded bytes at decoded offsets, checking each frame
            reader = DecodingReader(reader, info.encoding, where=self.location, step=self.step, file=info.file)
        if reader.size != info.size:
            reader.close()
            raise CorruptCheckpointError(
                f"step {self.step}: shard {info.file}{held} is {reader.size} bytes, the manifest says "
                f"{info.size} (truncated, extended or replaced)",
                step=self.step,
                file=info.file,
            )
        return reader

    def describe(self, entry: TensorEntry) -> tuple[str, int | None]:
        return self.manifest.shards[entry.shard].file, self.step

    def read(self, requests: Sequence[ReadRequest], *, executor: Executor) -> float:
        """Read and verify tensors into the requests' buffers; returns seconds spent."""
        for req in requests:  # open (and size-check) every shard before reading any byte
            self.reader(req.entry.shard)
        return read_tensors(
            self.reader,
            requests,
            chunk_bytes=self.manifest.chunk_bytes,
            executor=executor,
            describe=self.describe,
        )

    def close(self) -> None:
        try:
            with self._lock:
                readers, self._readers = list(self._readers.values()), {}
                for reader in readers:
                    reader.close()
        finally:  # a reader that fails to close must not leave the step leased (renewed) for good
            if self.lease is not None:
                self.lease.release()

    def __enter__(self) -> OpenCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Catalog:
    """Committed checkpoints in one storage root."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._cache: dict[int, Manifest] = {}
        self._lock = threading.Lock()
        self.pins = Pins()  # bases of this process's unfinished incremental saves: retention keeps them
        self.kept_by_references = 0  # steps the last retention pass kept only because others reference them
        self.tags = TagStore(storage)  # movable tags (tags.py): retention keeps the steps they point to
        self.leases = LeaseStore(storage)  # read leases of other processes (leases.py): retention keeps those steps

    # -- listing ----------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, ascending (a directory without a manifest is not one)."""
        return committed_steps(self.storage)

    def damaged(self) -> list[str]:
        """Step directories that hold no manifest on a file system (where a commit renames a complete
        directory into place, so ``step-N`` without ``manifest.json`` was damaged or made by hand). Never
        counted as checkpoints, never deleted by retention: a person should look. Empty on object stores,
        where ``step-N/`` without a manifest is an attempt in progress or a leftover."""
        if not self.storage.capabilities.atomic_rename:
            return []
        lacking = [
            name
            for name in self.storage.list_dirs("")
            if parse_step_dirname(name) is not None and not self.storage.exists(f"{name}/{MANIFEST_NAME}")
        ]
        if not lacking:
            return []
        # A checkpoint deleted (renamed away whole) between the listing and the manifest check looks the same:
        # only a directory still listed afterwards, and still without its manifest, is damaged.
        listed = set(self.storage.list_dirs(""))
        return sorted(n for n in lacking if n in listed and not self.storage.exists(f"{n}/{MANIFEST_NAME}"))

    def manifest(self, step: int, part: RankPart | None = None) -> Manifest:
        """The validated manifest of ``step`` (cached: committed checkpoints never change); with ``part``, one
        rank's view of it (format/view.py, not cached) unless the whole manifest is."""
        with self._lock:
            cached = self._cache.get(step)
        if cached is not None:
            return cached
        key = f"{step_dirname(step)}/{MANIFEST_NAME}"
        try:
            data = self.storage.get(key, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint of step {step} in {self.storage.uri}") from None
        manifest = Manifest.parse(data, path=f"{self.storage.uri.rstrip('/')}/{key}", expect_step=step, part=part)
        if manifest.part is None:  # a view is not the checkpoint: never served to a caller wanting it whole
            with self._lock:
                self._cache[step] = manifest
        return manifest

    def pin(self, step: int | None = None) -> Manifest | None:
        """The manifest of ``step`` (default: the newest committed checkpoint, found by listing the root),
        pinned against this catalog's retention until ``pins.unpin(step)``; None when there is none (or it
        cannot be read, or it is being deleted)."""
        if step is None:
            steps = self.steps()
            if not steps:
                return None
            step = steps[-1]

        def read(step: int) -> Manifest | None:
            try:
                return self.manifest(step)
            except (FormatError, CheckpointNotFoundError):
                return None

        return self.pins.pin(step, read)

    def unpin(self, step: int) -> None:
        self.pins.unpin(step)

    def remember(self, manifest: Manifest) -> CheckpointInfo:
        """Cache the manifest of a checkpoint this process just committed, and return its info."""
        with self._lock:
            self._cache[manifest.step] = manifest
        return CheckpointInfo.from_manifest(manifest, self.location(manifest.step))

    def info(self, step: int, movable: dict[int, tuple[str, ...]] | None = None) -> CheckpointInfo:
        """The info of ``step``; its tags include the movable tags (``movable``: ``tags.by_step()``, read once
        by a caller listing many steps)."""
        info = CheckpointInfo.from_manifest(self.manifest(step), self.location(step))
        extra = (self.tags.by_step() if movable is None else movable).get(step, ())
        return replace(info, tags=tuple(dict.fromkeys(info.tags + extra))) if extra else info

    def location(self, step: int) -> str:
        return f"{self.storage.uri.rstrip('/')}/{step_dirname(step)}"

    def entries(self) -> Iterator[tuple[int, CheckpointInfo | None, TiersaveError | None]]:
        """Every committed step with its info, or the error that prevents reading its manifest."""
        movable = self.tags.by_step()
        for step in self.steps():
            try:
                yield step, self.info(step, movable), None
            except (FormatError, CheckpointNotFoundError) as exc:
                yield step, None, exc

    def infos(self) -> list[CheckpointInfo]:
        """Infos of the checkpoints whose manifests are valid, ascending by step."""
        return [info for _, info, _ in self.entries() if info is not None]

    def find(self, step: int | None = None, tag: str | None = None) -> list[int]:
        """Candidate steps for a restore, newest first: ``step`` alone, those tagged ``tag``, or all. A movable
        tag ``tag`` wins over manifest tags: it names one step (an error if that step is gone)."""
        moved = self.tags.resolve(tag) if tag is not None else None
        if moved is not None and (step is None or step == moved.step):
            return [moved.step]
        if step is not None:
            if step not in self.steps():
                raise CheckpointNotFoundError(f"no checkpoint of step {step} in {self.storage.uri}")
            if tag is not None and tag not in self.manifest(step).tags:
                raise CheckpointNotFoundError(f"step {step} in {self.storage.uri} is not tagged {tag!r}")
            return [step]
        steps = sorted(self.steps(), reverse=True)
        if tag is None:
            return steps
        tagged = []
        for s in steps:
            try:
                if tag in self.manifest(s).tags:
                    tagged.append(s)
            except FormatError:
                continue
        if not tagged:
            raise CheckpointNotFoundError(f"no checkpoint tagged {tag!r} in {self.storage.uri}")
        return tagged

    # -- reading ----------------------------------------------------------------------------------

    def open(self, step: int, part: RankPart | None = None) -> OpenCheckpoint:
        """``step`` opened for reading under a read lease (leases.py) on it and on the steps it references,
        held until the checkpoint is closed (a committed manifest never changes: the lease checks it still is).
        ``part``: a rank's restore reads only its view (:meth:`manifest`)."""
        m = self.manifest(step, part)
        return OpenCheckpoint(self.storage, m, step_dirname(step), self.leases.take(step, m.referenced_steps))

    def verify(
        self, step: int, *, executor: Executor | None = None, progress: Callable[[int, int], None] | None = None
    ) -> VerifyReport:
        """Read every byte of ``step``: tensor chunks against their checksums, padding must be zero.

        ``progress(bytes_checked, tensor_bytes)`` is called after each batch of reads (at most 256 MiB)."""
        start = time.perf_counter()
        errors: list[str] = []
        checked = 0
        try:
            ckpt = self.open(step)
        except (FormatError, CheckpointNotFoundError) as exc:
            return VerifyReport(step, False, 0, time.perf_counter() - start, [str(exc)])
        notes = []
        if not ckpt.manifest.manifest_verified:
            notes.append(
                f"step {step}: the manifest was written with format {ckpt.manifest.format_version} and is not "
                "covered by a checksum of its own (tensor bytes are)"
            )
        own = executor is None
        pool = executor or ThreadPoolExecutor(knobs.io_threads(), thread_name_prefix="tiersave-verify")
        try:
            with ckpt:
                m = ckpt.manifest
                try:  # open and size-check every shard before allocating anything for its tensors
                    for index in range(len(m.shards)):
                        ckpt.reader(index)
                except (FormatError, ObjectNotFoundError) as exc:
                    errors.append(str(exc))
                requests = []
                pending = 0
                for entry in m.tensors.values():
                    if errors:
                        break
                    requests.append(ReadRequest(entry, memoryview(bytearray(entry.nbytes))))
                    pending += entry.nbytes
                    if pending > (256 << 20):  # verify in bounded memory
                        checked += self._verify_batch(ckpt, requests, pool, errors)
                        requests, pending = [], 0
                        if progress is not None:
                            progress(checked, m.total_bytes)
                checked += self._verify_batch(ckpt, requests, pool, errors)
                if progress is not None:
                    progress(checked, m.total_bytes)
                if not errors:
                    checked += self._verify_padding(ckpt, errors)
        finally:
            if own:
                pool.shutdown()
        if errors and not self.storage.exists(f"{step_dirname(step)}/{MANIFEST_NAME}"):  # another's retention
            errors = [f"no checkpoint of step {step} in {self.storage.uri}: it was deleted while it was verified"]
        return VerifyReport(step, not errors, checked, time.perf_counter() - start, errors, notes)

    @staticmethod
    def _verify_batch(ckpt: OpenCheckpoint, requests: list[ReadRequest], pool: Executor, errors: list[str]) -> int:
        if not requests or errors:
            return 0
        try:
            ckpt.read(requests, executor=pool)
        except (FormatError, ObjectNotFoundError) as exc:
            errors.append(str(exc))
            return 0
        return sum(r.entry.nbytes for r in requests)

    @staticmethod
    def _verify_padding(ckpt: OpenCheckpoint, errors: list[str]) -> int:
        m = ckpt.manifest
        checked = 0
        for index, shard in enumerate(m.shards):
            covered = sorted((t.offset, t.offset + t.nbytes) for t in m.tensors.values() if t.shard == index)
            gaps, cursor = [], 0
            for begin, end in covered:
                if begin > cursor:
                    gaps.append((cursor, begin))
                cursor = max(cursor, end)
            if cursor < shard.size:
                gaps.append((cursor, shard.size))
            reader = ckpt.reader(index)
            for begin, end in gaps:
                for off, length in chunk_ranges(end - begin, 1 << 20):
                    buf = bytearray(length)
                    reader.read_into(begin + off, memoryview(buf))
                    if buf.count(0) != length:
                        errors.append(f"step {m.step}: shard {shard.file} has non-zero padding at byte {begin + off}")
                        return checked
                    checked += length
        return checked

    # -- deletion ---------------------------------------------------------------------------------

    def delete(self, step: int, reclaim: Reclaim | None = None) -> None:
        """Delete a committed checkpoint: un-commit it atomically first, then remove its data (``reclaim``: later)."""
        attempts: set[str] = set()
        if not self.storage.capabilities.atomic_rename:  # an object store deletes the attempts the manifest names
            try:
                attempts = {s.file.split("/", 1)[0] for s in self.manifest(step).shards if "/" in s.file}
            except (FormatError, CheckpointNotFoundError):
                pass
        delete_committed(self.storage, step, attempts, reclaim)
        with self._lock:
            self._cache.pop(step, None)

    def prune(
        self,
        keep_last: int | None = None,
        *,
        policy: RetentionPolicy | None = None,
        protected: Collection[int] = (),
        dry_run: bool = False,
        force: bool = False,
        leftovers: bool = True,
        reclaim: Reclaim | None = None,
    ) -> PruneResult:
        """Apply retention (``keep_last`` newest, or ``policy``; neither: delete no checkpoint) and remove
        the leftovers of interrupted saves. The newest checkpoint, ``protected`` steps and the steps a movable
        tag points to always stay (a tag file that cannot be read is logged, and protects nothing).

        Args:
            dry_run: report what would be deleted, delete nothing.
            force: also remove temporary directories or attempts made on other hosts.
            leftovers: also look for (and remove) leftovers of interrupted saves.
            reclaim: remove the deleted checkpoints' files later (reclaim.py), once renamed away.
        """
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ConfigError(f"keep_last must be a positive integer or None, got {keep_last!r}")
        if keep_last is not None and policy is not None:
            raise ConfigError("give either keep_last or policy, not both")
        chosen = KeepLast(keep_last) if keep_last is not None else policy
        steps = self.steps()
        if chosen is None:
            doomed: list[int] = []
        else:
            infos = [info for _, info, _ in self.entries() if info is not None]
            # unreadable manifests are never deleted by retention: a person should look at them
            tagged, bad = self.tags.all()
            for name, exc in bad.items():
                log.warning("retention in %s ignores the unreadable tag %r: %s", self.storage.uri, name, exc)
            keep = {*protected, *(t.step for t in tagged.values())}
            doomed = list(plan_retention(infos, chosen, protected=keep).delete)
        pinned, generation = self.pins.pinned()
        doomed, refs = unneeded(doomed, pinned, steps, self.manifest)  # newest first
        self.kept_by_references = len(refs) - len(doomed)  # a long chain makes the next save full (references.py)
        found = self.leftovers() if leftovers else []
        removable = [n for n, s in found if s == "dead" or (s == "unknown" and force)]
        done: list[int] = []
        spared: set[int] = set()  # what a doomed step left in place references: it stays too
        for step in doomed:  # newest first: stopping early leaves every kept step's base in place
            if dry_run:  # what a real pass would delete now: not the steps a reader holds (nor what they need)
                if step not in spared and not self.leases.live(step):
                    done.append(step)
            else:
                with self.pins.deleting(step, generation) as allowed:
                    if not allowed:  # a save pinned a base since: its references may be among these
                        break
                    if step not in spared and step not in self.tags.by_step():  # not tagged since the plan
                        with self.leases.deleting(step) as unleased:  # no reader of another process holds it
                            if unleased:
                                self.delete(step, reclaim)
                                done.append(step)
            if not done or done[-1] != step:
                spared |= refs[step]
        doomed = sorted(done)
        if not dry_run:
            self.leases.clean(self.steps)  # expired leases of dead readers
            removable = self.clean_leftovers(force=force, reclaim=reclaim) if leftovers else []
        return PruneResult(
            deleted=doomed,
            kept=[s for s in steps if s not in doomed],
            leftovers_removed=removable,
            live_saves=[n for n, s in found if s == "live"],
        )

    def leftovers(self) -> list[tuple[str, str]]:
        """Leftovers of interrupted saves and deletes with their status: ``dead`` (interrupted), ``live``
        (a running save on this host) or ``unknown`` (made on another host, within the grace of
        :meth:`clean_leftovers`). On a file system these are
        temporary and trash directories; on an object store, save attempts no manifest refers to."""
        if not self.storage.capabilities.atomic_rename:
            from .commit import MarkerCommit

            return [(item.prefix, item.status) for item in MarkerCommit(self.storage).leftovers()]
        out = []
        for name in self.storage.list_dirs(""):
            if not is_leftover(name):
                continue
            alive = owner_alive(name) if ".tmp-" in name else False
            if alive is None:  # another host's: abandoned once untouched for the grace, as on an object store
                newest = max((info.mtime for info in self.storage.list(name)), default=time.time())
                alive = None if time.time() - newest < knobs.leftover_grace_s() else False
            out.append((name, "live" if alive else ("dead" if alive is False else "unknown")))
        return out

    def clean_leftovers(self, *, force: bool = False, reclaim: Reclaim | None = None) -> list[str]:
        """Remove leftovers of interrupted saves and deletes. A live save's data is always kept; data made
        on another host (shared file system, object store) only with ``force``, or once nothing was added to
        it for ``TIERSAVE_LEFTOVER_GRACE_S`` (a day by default; an empty one is kept); ``reclaim``: later."""
        if not self.storage.capabilities.atomic_rename:
            from .commit import MarkerCommit

            return MarkerCommit(self.storage).clean_leftovers(force=force, older_than_s=knobs.leftover_grace_s())
        removed = []
        for name, status in self.leftovers():
            if status == "dead" or (status == "unknown" and force):
                reclaim(self.storage, name) if reclaim is not None else self.storage.delete_prefix(name)
                removed.append(name)
        return removed
