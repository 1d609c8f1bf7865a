"""How a checkpoint becomes visible: the commit strategies (docs/format.md section 6).

``RenameCommit`` (file systems with atomic rename): data goes to ``step-N.tmp-<token>/``; the manifest
is written last, durably, inside it; the directory is renamed to ``step-N`` without replacing one that
exists, and the root is fsynced. A crash at any instant leaves either the old set of committed
checkpoints or the old set plus the new one, never a partial checkpoint under a committed name.

``MarkerCommit`` (object stores: no rename, but a create-only put): each save attempt writes its shards
under its own prefix ``step-N/attempt-<token>/``; the manifest ``step-N/manifest.json`` is written last
with a create-only put (``If-None-Match: *``), and that put is the commit. A prefix without a manifest is
invisible. Two writers racing on one step both upload, only one create-only put succeeds, and the loser
gets :class:`AlreadyExistsError`; since every attempt has its own prefix, no attempt ever overwrites an
object of another, committed or not. A re-save after a crashed attempt simply uses a new prefix.

Choose with :func:`commit_for` (by capabilities, never by type).

Call protocol (one save, one thread): ``begin(step)`` -> write shards at ``f"{prefix}/{name}"`` and
record ``shard_file(prefix, name)`` in the manifest -> ``commit(prefix, step, manifest)`` or
``abort(prefix)``.

Scope: the atomic visibility of one checkpoint on one storage (which steps are committed now, read so that a
concurrent commit and deletion cannot hide every step), and recognising the leftovers of attempts whose
writer died. Anti-scope: what the manifest says (format/), writing the shards (engine/), listing and
deleting committed checkpoints (catalog.py).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import zlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ._crash import crashpoint
from .errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    ObjectNotFoundError,
    StorageError,
)
from .format.layout import MANIFEST_NAME, MAX_MANIFEST_BYTES, new_token, parse_step_dirname, step_dirname, tmp_dirname
from .storage.base import Storage

if TYPE_CHECKING:
    from .format.manifest import Manifest, ShardInfo

log = logging.getLogger(__name__)


def _host_id() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def tmp_token() -> str:
    """``<pid>-<host id>-<random>``: lets ``prune`` tell a live save's directory from a dead one's."""
    return f"{os.getpid()}-{_host_id()}-{new_token()}"


def parse_token_owner(token: str) -> tuple[int, str] | None:
    """The (pid, host id) in a token made by :func:`tmp_token`, if it has that form."""
    parts = token.split("-")
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1]


def parse_tmp_owner(name: str) -> tuple[int, str] | None:
    """The (pid, host id) that created a temporary directory, if its token has that form."""
    return parse_token_owner(name.partition(".tmp-")[2])


def owner_alive(name: str) -> bool | None:
    """True/False if the creator of ``name`` is known to be alive/dead on this host; None if unknown."""
    return _alive(parse_tmp_owner(name))


def _alive(owner: tuple[int, str] | None) -> bool | None:
    if owner is None or owner[1] != _host_id():
        return None
    try:
        os.kill(owner[0], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CommitStrategy(Protocol):
    """How a save becomes visible on one storage. Implementations: RenameCommit, MarkerCommit.

    Call protocol (one save, one thread): ``begin(step)`` -> write every shard at ``f"{prefix}/{name}"``
    and make it durable -> build the manifest with ``shard_file(prefix, name)`` as each shard's ``file``
    -> ``commit(prefix, step, manifest)``; on any failure ``abort(prefix)`` instead. Different saves may run
    these sequences concurrently from different threads or processes.
    """

    storage: Storage

    def begin(self, step: int, token: str | None = None) -> str:
        """Check that ``step`` is not committed and return the prefix this attempt writes under.

        Args:
            step: the step being saved.
            token: the attempt's token (:func:`tmp_token` form), when several processes write one attempt
                (the ranks of a collective save agree on it); by default a fresh one of this process.

        Raises:
            AlreadyExistsError: ``step`` is already committed (a checkpoint is never overwritten).
        """
        ...

    def prefix_of(self, step: int, token: str) -> str:
        """The prefix :meth:`begin` returns for ``step`` and ``token``, with no I/O and no check (what a
        process that did not begin the attempt, or failed before it, names to remove it)."""
        ...

    def shard_file(self, prefix: str, name: str) -> str:
        """The manifest's ``file`` for a shard written at ``f"{prefix}/{name}"``."""
        ...

    def commit(self, prefix: str, step: int, manifest: bytes) -> str:
        """Write the manifest and make the checkpoint visible, atomically; returns its prefix (``step-N``).

        Raises:
            AlreadyExistsError: another writer committed ``step`` first; this attempt stays invisible and
                the caller should ``abort(prefix)``.
        """
        ...

    def abort(self, prefix: str) -> None:
        """Remove what this attempt wrote. Never touches a committed checkpoint."""
        ...

    def hand_over(self, prefix: str) -> None:
        """This process is done with ``prefix``: another one (rank 0 of a node-by-node drain) commits or
        aborts it, so this process stops counting it among its own live attempts."""
        ...


def _refuse_committed(storage: Storage, step: int) -> str:
    """``step-N`` if ``step`` is not committed in ``storage``; else :class:`AlreadyExistsError`."""
    final = step_dirname(step)
    if storage.exists(f"{final}/{MANIFEST_NAME}"):
        raise AlreadyExistsError(
            f"step {step} is already committed in {storage.uri}; a checkpoint is never "
            "overwritten: delete it first (tiersave prune) or save under another step",
            tier=storage.uri,
            key=final,
        )
    return final


class RenameCommit:
    """Commit by renaming a fully written temporary directory into place."""

    def __init__(self, storage: Storage) -> None:
        if not storage.capabilities.atomic_rename:
            raise ConfigError(f"{storage.uri} has no atomic rename; it needs a marker commit")
        self.storage = storage

    def begin(self, step: int, token: str | None = None) -> str:
        _refuse_committed(self.storage, step)
        crashpoint("save_begin")
        return self.prefix_of(step, token or tmp_token())

    def prefix_of(self, step: int, token: str) -> str:
        """``step-N.tmp-<token>``: the temporary directory the commit renames into ``step-N``."""
        return tmp_dirname(step, token)

    def shard_file(self, prefix: str, name: str) -> str:
        """Shards sit directly in the directory that the rename turns into ``step-N``."""
        return name

    def commit(self, prefix: str, step: int, manifest: bytes) -> str:
        self.storage.put(f"{prefix}/{MANIFEST_NAME}", manifest, mode="create")  # fsyncs file and directory
        crashpoint("after_manifest")
        final = step_dirname(step)
        self.storage.rename_prefix(prefix, final)  # no-replace rename, then fsync of the root
        crashpoint("after_commit")
        return final

    def abort(self, prefix: str) -> None:
        self.storage.delete_prefix(prefix)

    def hand_over(self, prefix: str) -> None:
        """Nothing to forget: a rename attempt's liveness is read from its name (its owner's pid and host)."""


ATTEMPT_PREFIX = "attempt-"
_ATTEMPT_RE = re.compile(r"^attempt-([0-9]{1,10}-[0-9a-f]{8}-[0-9a-f]{16})$")


def attempt_dirname(token: str) -> str:
    """The per-attempt prefix component of a marker-committed save: ``attempt-<pid>-<host>-<random>``."""
    return f"{ATTEMPT_PREFIX}{token}"


@dataclass(frozen=True)
class Leftover:
    """Data of a marker-committed save attempt that is not part of any committed checkpoint.

    Attributes:
        prefix: ``step-N/attempt-<token>``.
        step: the step the attempt was saving.
        status: ``"dead"`` (its process is gone, it was abandoned by a process that is still running, or
            it is older than the caller's age limit), ``"live"`` (a save in progress) or ``"unknown"``
            (made on another host).
        step_committed: the step has a committed checkpoint (this attempt crashed or lost a race).
        objects: objects stored under the prefix.
        uploads: unfinished multipart uploads under the prefix (invisible, but stored and billed).
    """

    prefix: str
    step: int
    status: str
    step_committed: bool
    objects: int = 0
    uploads: int = 0


# Attempts begun by this process and not yet committed or aborted: an attempt of this pid that is not
# here was abandoned (its abort failed, e.g. the server was down) and is garbage, although we are alive.
_ACTIVE: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


def _own_token(token: str) -> bool:
    owner = parse_token_owner(token)
    return owner is not None and owner == (os.getpid(), _host_id())


class MarkerCommit:
    """Commit by writing the manifest last with a create-only put (object stores, no atomic rename).

    Layout of one step (docs/format.md sections 2 and 6)::

        step-0000000100/manifest.json                           the commit (create-only put)
        step-0000000100/attempt-<pid>-<host>-<rand>/shard-00000-000.bin

    The manifest names shards as ``attempt-.../shard-...`` (a two-component shard path). Guarantees:

    - invisible until committed: ``Catalog`` lists a step only when its manifest exists, and the manifest
      is written only after every shard's upload completed;
    - never overwritten: a committed step's manifest cannot be replaced (create-only), and its shards
      live under a prefix no other attempt writes to;
    - a racing second writer gets :class:`AlreadyExistsError` from :meth:`commit` and its own objects
      are removed by :meth:`abort`;
    - a lost response: if the manifest put succeeded but its response was lost and the retry answered
      "exists", the stored manifest is read back and compared byte for byte (it names this attempt's
      unique prefix), so the save is reported committed exactly when it is.

    Leftovers (attempts that crashed, lost a race, or whose abort could not reach the store) are found
    and removed by :meth:`leftovers` / :meth:`clean_leftovers`, including unfinished multipart uploads.

    Thread safety: many saves may use one instance, or several instances, concurrently (the in-process
    record of live attempts is shared and locked).
    """

    def __init__(self, storage: Storage) -> None:
        if not storage.capabilities.conditional_put:
            raise ConfigError(f"{storage.uri} has no create-only put; a marker commit would not be atomic")
        self.storage = storage

    def begin(self, step: int, token: str | None = None) -> str:
        _refuse_committed(self.storage, step)
        crashpoint("save_begin")
        prefix = self.prefix_of(step, token or tmp_token())
        with _ACTIVE_LOCK:
            _ACTIVE.add(prefix)
        return prefix

    def prefix_of(self, step: int, token: str) -> str:
        """``step-N/attempt-<token>``: the attempt's own prefix under the step's."""
        return f"{step_dirname(step)}/{attempt_dirname(token)}"

    def shard_file(self, prefix: str, name: str) -> str:
        """``attempt-<token>/<name>``: shards are named relative to ``step-N``."""
        return f"{self._split(prefix)[1]}/{name}"

    def _split(self, prefix: str) -> tuple[int, str]:
        head, _, attempt = prefix.partition("/")
        step = parse_step_dirname(head)
        if step is None or not _ATTEMPT_RE.match(attempt):
            raise ConfigError(f"{prefix!r} is not a save prefix made by MarkerCommit.begin")
        return step, attempt

    def commit(self, prefix: str, step: int, manifest: bytes) -> str:
        owner_step, _ = self._split(prefix)
        if owner_step != step:
            raise ConfigError(f"prefix {prefix!r} belongs to step {owner_step}, not {step}")
        final = step_dirname(step)
        key = f"{final}/{MANIFEST_NAME}"
        try:
            self.storage.put(key, manifest, mode="create")
        except AlreadyExistsError:
            if not self._is_ours(key, manifest):
                raise AlreadyExistsError(
                    f"step {step} was committed by another writer in {self.storage.uri} while this save was "
                    f"uploading; the committed checkpoint is unchanged and this attempt ({prefix}) is discarded",
                    tier=self.storage.uri,
                    key=key,
                ) from None
            log.info("manifest of step %s in %s was already ours (a retried put)", step, self.storage.uri)
        with _ACTIVE_LOCK:
            _ACTIVE.discard(prefix)
        crashpoint("after_manifest")
        crashpoint("after_commit")
        return final

    def hand_over(self, prefix: str) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(prefix)

    def _is_ours(self, key: str, manifest: bytes) -> bool:
        try:
            return self.storage.get(key, max_bytes=len(manifest)) == manifest
        except (FormatError, ObjectNotFoundError):
            return False

    def abort(self, prefix: str) -> None:
        """Delete this attempt's objects and abort its unfinished multipart uploads (best effort for the
        latter: a storage without that housekeeping, or without the credentials for it, is skipped)."""
        self._split(prefix)
        with _ACTIVE_LOCK:
            _ACTIVE.discard(prefix)  # from now on a leftover of it is garbage, even if this delete fails
        self.storage.delete_prefix(prefix)
        _abort_uploads(self.storage, prefix)

    # -- leftovers ---------------------------------------------------------------------------------

    def leftovers(self, *, older_than_s: float | None = None) -> list[Leftover]:
        """Attempt prefixes that belong to no committed checkpoint and still hold objects or unfinished
        multipart uploads, with their status.

        Args:
            older_than_s: an attempt made on another host (status unknown) whose newest object or upload
                is at least this old counts as dead (saves do not run for days). None: never.
        """
        found: dict[str, dict[str, float | int]] = {}
        for name in self.storage.list_dirs(""):
            if parse_step_dirname(name) is None:
                continue
            for attempt in self.storage.list_dirs(name):
                if not _ATTEMPT_RE.match(attempt):
                    continue
                prefix = f"{name}/{attempt}"
                mtimes = [info.mtime for info in self.storage.list(prefix)]
                if mtimes:  # some stores (SeaweedFS) keep empty "directories" after deletes: skip those
                    entry = found.setdefault(prefix, {"objects": 0, "uploads": 0, "newest": 0.0})
                    entry["objects"] = len(mtimes)
                    entry["newest"] = max(mtimes)
        for upload in _list_uploads(self.storage):
            parts = upload.key.split("/")
            if len(parts) < 3 or parse_step_dirname(parts[0]) is None or not _ATTEMPT_RE.match(parts[1]):
                continue
            entry = found.setdefault(f"{parts[0]}/{parts[1]}", {"objects": 0, "uploads": 0, "newest": 0.0})
            entry["uploads"] = int(entry["uploads"]) + 1
            entry["newest"] = max(float(entry["newest"]), upload.initiated)
        out = []
        now = time.time()
        referenced_by_step: dict[int, set[str] | None] = {}
        with _ACTIVE_LOCK:
            active = set(_ACTIVE)
        for prefix in sorted(found):
            entry = found[prefix]
            head, _, attempt = prefix.partition("/")
            step = parse_step_dirname(head)
            if step is None:
                continue
            if step not in referenced_by_step:
                referenced_by_step[step] = self._referenced(step)
            referenced = referenced_by_step[step]
            if referenced is not None and (attempt in referenced or "*" in referenced):
                continue
            token = attempt[len(ATTEMPT_PREFIX) :]
            if _own_token(token):
                status = "live" if prefix in active else "dead"
            else:
                alive = _alive(parse_token_owner(token))
                status = "live" if alive else "dead" if alive is False else "unknown"
            if status == "unknown" and older_than_s is not None and now - float(entry["newest"]) >= older_than_s:
                status = "dead"
            out.append(
                Leftover(prefix, step, status, referenced is not None, int(entry["objects"]), int(entry["uploads"]))
            )
        return out

    def _referenced(self, step: int) -> set[str] | None:
        """Attempt names the committed manifest of ``step`` uses; None if not committed; ``{"*"}`` if the
        manifest cannot be read (then nothing of that step is touched)."""
        from .format.manifest import Manifest

        key = f"{step_dirname(step)}/{MANIFEST_NAME}"
        try:
            data = self.storage.get(key, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            return None
        except (FormatError, StorageError):
            return {"*"}
        try:
            manifest = Manifest.parse(data, path=f"{self.storage.uri}/{key}", expect_step=step)
        except (FormatError, CheckpointNotFoundError):
            return {"*"}
        return {s.file.split("/", 1)[0] for s in manifest.shards if "/" in s.file}

    def clean_leftovers(self, *, force: bool = False, older_than_s: float | None = None) -> list[str]:
        """Remove dead attempts: their objects and their unfinished multipart uploads. ``unknown`` ones
        (another host's) go too with ``force``; a live save is never touched.

        Args:
            force: also remove attempts of unknown status.
            older_than_s: see :meth:`leftovers`.

        Returns:
            The prefixes removed.
        """
        removed = []
        for item in self.leftovers(older_than_s=older_than_s):
            if item.status == "dead" or (item.status == "unknown" and force):
                if item.objects:
                    self.storage.delete_prefix(item.prefix)
                if item.uploads:
                    _abort_uploads(self.storage, item.prefix)
                removed.append(item.prefix)
        return removed


def _list_uploads(storage: Storage) -> list[Any]:
    lister = getattr(storage, "list_multipart_uploads", None)
    if lister is None:
        return []
    try:
        return list(lister(""))
    except ConfigError as exc:  # no static credentials for the housekeeping requests
        log.debug("cannot list multipart uploads on %s: %s", storage.uri, exc)
        return []


def _abort_uploads(storage: Storage, prefix: str) -> None:
    abort = getattr(storage, "abort_multipart_uploads", None)
    if abort is None:
        return
    try:
        abort(prefix)
    except ConfigError as exc:  # no static credentials for the housekeeping requests
        log.debug("cannot abort multipart uploads under %s on %s: %s", prefix, storage.uri, exc)


def committed_steps(storage: Storage) -> list[int]:
    """Steps committed on ``storage`` (a manifest in ``step-N/``), ascending.

    A listing and the manifest checks after it are not one atomic read: a writer may commit step N+1 after
    the listing and delete step N before its check, and a reader that saw neither would find no checkpoint
    where one always existed. Writers commit a newer step before deleting an older one, so when the newest
    directory listed turned out to have no manifest, the directory is listed once more: a step committed
    meanwhile shows up there. (An attempt in progress, a directory without a manifest newer than every
    committed step, costs that one listing more, never a loop.)
    """
    for again in (True, False):
        committed: list[int] = []
        lacking: list[int] = []
        for name in storage.list_dirs(""):
            step = parse_step_dirname(name)
            if step is not None:
                (committed if storage.exists(f"{name}/{MANIFEST_NAME}") else lacking).append(step)
        if not again or not lacking or (committed and max(committed) > max(lacking)):
            break
    return sorted(committed)


def commit_for(storage: Storage) -> RenameCommit | MarkerCommit:
    """The commit strategy for ``storage``, chosen by its capabilities.

    Atomic rename (local disk, /dev/shm, POSIX shared file systems) -> :class:`RenameCommit`; otherwise a
    create-only put (object stores) -> :class:`MarkerCommit`.

    Raises:
        ConfigError: the storage offers neither, so no save on it could be atomic.
    """
    caps = storage.capabilities
    if caps.atomic_rename:
        return RenameCommit(storage)
    if caps.conditional_put:
        return MarkerCommit(storage)
    raise ConfigError(f"{storage.uri} has neither atomic rename nor a create-only put: no atomic commit is possible")


def check_shards_visible(
    storage: Storage, prefix: str, manifest: Manifest, ranks: Collection[int] | None = None, *, rank: int = 0
) -> None:
    """Rank 0 (``rank``: the node leader checking its node), before committing: every rank's shard is where the
    commit will make it visible, at its size (only the shards of ``ranks`` when given: a node-local memory tier
    holds its own node's ranks' shards).

    Raises:
        CorruptCheckpointError: a shard is missing or has another size: the root is not shared by the ranks
            (each node has its own disk or memory), a rank's write went elsewhere, or another process removed
            or changed the attempt's files after they were written (the only cause when it is ``rank``'s own).
    """
    for shard in manifest.shards:
        if (ranks is not None and shard.rank not in ranks) or shard.step is not None:
            continue  # a reference lies in an earlier committed step: saving.py checks that step is still there
        key = f"{prefix}/{shard.file.rsplit('/', 1)[-1]}"
        try:
            size = storage.head(key).size
        except ObjectNotFoundError:
            size = None
        if size != shard.size:
            raise CorruptCheckpointError(
                _not_visible(storage, prefix, manifest.step, shard, size, rank), step=manifest.step, file=shard.file
            )


def _not_visible(storage: Storage, prefix: str, step: int, shard: ShardInfo, size: int | None, rank: int) -> str:
    """Why ``shard`` is missing or has another size, as far as ``rank``, which checks, can tell: the root is to
    blame only for another rank's shard; its own shard it wrote itself where it now looks."""

    found = "not visible" if size is None else f"{size} bytes, not {shard.size}"
    text = f"step {step}: rank {shard.rank}'s shard {shard.file} is {found} to rank {rank} under {storage.uri}"
    try:
        emptied = next(iter(storage.list(prefix)), None) is None
    except StorageError:
        emptied = False
    if emptied:
        text += f" (nothing is left of the attempt {prefix})"
    removed = (
        "another process removed or changed the attempt's files after they were written (a second job, "
        "benchmark run or clean-up working in the same root, or a person); nothing is committed"
    )
    if shard.rank == rank:
        return f"{text}, although rank {rank} wrote it there itself before this check: {removed}"
    return (
        f"{text}; every rank must save to one root that all of them see (a shared file system or an object "
        f"store), not a node-local directory; if the root is shared, {removed}"
    )
