"""The narrow storage protocol every tier implements.

Scope: moving bytes to and from one place (a directory, /dev/shm, a bucket prefix) with stated
atomicity and durability. Anti-scope: checkpoint layout, manifests, checksums (a reader may compute the
CRC-32C of what it read, :class:`ChecksumReader`; comparing it is the engine's), torch.

Keys are ``/``-separated paths relative to the storage root, made of safe components (no empty, ``.``
or ``..`` component, no NUL, not absolute); backends reject anything else with :class:`ConfigError`
before touching the file system, so a name from a checkpoint can never escape the root.

Call protocol for writing one checkpoint (see ``tiersave.commit``):

1. ``open_writer(key, size_hint=n)`` for each shard; ``write_at`` from any number of threads; ``finish(size)`` makes
   the shard durable (fsync, or the upload completed); ``abort()`` discards it.
2. ``put(manifest_key, data, mode="create")`` writes the manifest atomically and durably.
3. Backends with ``capabilities.atomic_rename`` then ``rename_prefix(tmp, final)``; the rename is the
   commit. Object stores commit with step 2 alone.

Thread safety: a ``Storage`` may be used from many threads at once; a ``BlobWriter`` accepts concurrent
``write_at`` calls for disjoint ranges; ``finish``/``abort`` are called once, after all writes returned.
A ``BlobReader`` accepts concurrent ``read_into`` calls.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from ..errors import ConfigError

PutMode = Literal["overwrite", "create"]


@dataclass(frozen=True, slots=True)
class StorageCapabilities:
    """What a backend guarantees; the commit strategy and I/O engine choose by these, never by type.

    Attributes:
        atomic_rename: a prefix (directory) can be renamed atomically without replacing an existing one.
        conditional_put: ``put(mode="create")`` is an atomic create-only write.
        direct_io: O_DIRECT reads and writes are possible (the engine may still choose buffered I/O).
        durable: data survives a reboot of the machine (False for /dev/shm).
        shared: other nodes see the same data (object store, shared file system).
    """

    atomic_rename: bool
    conditional_put: bool
    direct_io: bool
    durable: bool
    shared: bool


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """Metadata of one stored object."""

    key: str
    size: int
    mtime: float


class BlobWriter(Protocol):
    """Writes one large object (a shard) in pieces, possibly from several threads."""

    key: str

    def write_at(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset``. Ranges of concurrent calls must not overlap."""

    def finish(self, size: int) -> None:
        """Set the object's final length to ``size`` and make it durable; then it is readable."""

    def abort(self) -> None:
        """Discard the object; safe to call more than once and after a failed ``finish``."""


class BlobReader(Protocol):
    """Reads ranges of one object, possibly from several threads."""

    key: str
    size: int

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes at ``[offset, offset + len(out))``; raises if the object is shorter."""

    def close(self) -> None: ...


@runtime_checkable
class RangesReader(Protocol):
    """A :class:`BlobReader` that can also fill many ranges in one call (optional: the engine reads range by
    range from readers without it)."""

    def read_ranges(self, ranges: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each ``(offset, out)`` (sorted by offset, not overlapping); raises if the object is shorter."""


@runtime_checkable
class ChecksumReader(Protocol):
    """A :class:`BlobReader` that can also return the CRC-32C of the bytes it filled (optional: the engine
    checksums the destination itself after ``read_into`` on readers without it). A backend offers it where
    the checksum costs less inside the read, e.g. in the same pass as a copy out of a bounce buffer."""

    def read_into_crc(self, offset: int, out: memoryview) -> int:
        """Fill ``out`` as ``read_into`` does; return the CRC-32C (Castagnoli) of ``out``'s bytes after it."""

    def read_ranges_crc(self, ranges: Sequence[tuple[int, memoryview]]) -> list[int]:
        """Fill each ``(offset, out)`` as ``RangesReader.read_ranges`` does; return each one's CRC-32C."""


@dataclass(frozen=True, slots=True)
class VersionedObject:
    """A whole object as one read returned it: its bytes, the store's time of that version's write and
    the version tag (S3's ``ETag``) that a conditional replace names."""

    data: bytes
    mtime: float
    version: str


@runtime_checkable
class ConditionalUpdate(Protocol):
    """A storage that can replace an object only while it is still the version read (optional; S3's
    ``If-Match`` on PUT). The object-store writer lock renews and takes over its lease with it, so that a
    lease written by another writer between the read and the write is never replaced."""

    def get_version(self, key: str, *, max_bytes: int | None = None) -> VersionedObject:
        """Read a whole object and the version of exactly those bytes (one request); raise
        :class:`ObjectNotFoundError` if there is none, :class:`FormatError` past ``max_bytes``."""

    def put_if_version(self, key: str, data: bytes | memoryview, version: str) -> None:
        """Replace ``key`` only if its current version is ``version``; raise
        :class:`PreconditionFailedError` if it changed or was deleted (nothing is written then). A store
        that ignores the condition replaces the object regardless: callers that rely on it probe for it."""


@runtime_checkable
class Storage(Protocol):
    """One tier's storage. See the module docstring for the call protocol and thread safety."""

    uri: str
    capabilities: StorageCapabilities

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        """Write a whole object atomically and durably. ``mode="create"`` raises
        :class:`AlreadyExistsError` instead of replacing an existing object."""

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Read a whole object; raise :class:`FormatError` before reading if it exceeds ``max_bytes``."""

    def open_reader(self, key: str) -> BlobReader: ...

    def open_writer(self, key: str, *, size_hint: int | None = None) -> BlobWriter:
        """Start writing a new object; fails with :class:`AlreadyExistsError` if ``key`` exists.

        ``size_hint`` is the object's final size when the caller knows it (a shard's planned size). A
        backend may use it to size its allocation: a file-system writer preallocates no more than this,
        so a writer killed midway leaves no more than the object would have held. Writing past it works.
        """

    def head(self, key: str) -> ObjectInfo:
        """Size and modification time; raises :class:`ObjectNotFoundError`."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under ``prefix`` (recursively), keys relative to the root, in no set order."""

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        """Names of the immediate sub-prefixes of ``prefix`` (directories, common prefixes)."""

    def delete(self, key: str) -> None:
        """Delete one object; a missing object is not an error."""

    def delete_prefix(self, prefix: str) -> None:
        """Delete everything under ``prefix``; a missing prefix is not an error. ``AlreadyExistsError`` where a
        directory could not be removed because an entry landed in it meanwhile (backends with directories)."""

    def rename_prefix(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` to ``dst`` without replacing an existing ``dst``, durably.

        Only backends with ``capabilities.atomic_rename``; others raise :class:`ConfigError`.
        """

    def close(self) -> None: ...


def check_key(key: str, *, allow_empty: bool = False) -> builtins.list[str]:
    """Split ``key`` into components, rejecting anything that could leave the storage root."""
    if key == "" and allow_empty:
        return []
    if not isinstance(key, str) or not key or "\x00" in key or key.startswith("/") or "\\" in key:
        raise ConfigError(f"invalid storage key {key!r}")
    parts = key.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise ConfigError(f"invalid storage key {key!r}: empty, '.' or '..' component")
    return parts
