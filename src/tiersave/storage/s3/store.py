"""The S3 :class:`~tiersave.storage.base.Storage`: :class:`S3Storage`, a bucket prefix reached through obstore.

Scope: configuring the obstore client from :class:`~tiersave.storage.s3.options.S3Options`, whole-object
puts (overwrite, or create-only with ``If-None-Match: *`` and a bounded retry of conflicting conditional
writes) and gets, opening readers and writers, head/list/delete, the read pool's and the signed-request
client's lifetimes, and multipart housekeeping (which uploads to abort). Anti-scope: the URI
(``options.py``), error mapping (``errors.py``), ranged reads (``reader.py``), multipart writes
(``writer.py``), request signing (``control.py``), the commit protocol (``tiersave.commit.MarkerCommit``).
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as _dt
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import obstore
from obstore import exceptions as _obx
from obstore.store import S3Store

from ...errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    ObjectNotFoundError,
    PreconditionFailedError,
)
from ..base import ObjectInfo, PutMode, StorageCapabilities, VersionedObject, check_key
from .control import MultipartUpload, S3Control
from .errors import error_summary, mapped_errors
from .lease import Lease
from .options import MAX_SINGLE_PUT_BYTES, S3Options
from .reader import S3BlobReader
from .views import byte_view
from .writer import S3BlobWriter


class S3Storage:
    """A bucket prefix on an S3-compatible service. URIs and guarantees: :mod:`tiersave.storage.s3`.

    Args:
        options: where and how; see :class:`S3Options`. ``S3Storage.from_uri`` builds them from a URI.

    Call protocol and thread safety are those of :mod:`tiersave.storage.base`. Capabilities: no atomic
    rename (commit with :class:`tiersave.commit.MarkerCommit`), conditional put, no direct I/O, durable,
    shared.
    """

    def __init__(self, options: S3Options) -> None:
        self.options = options
        self.uri = options.uri
        self.capabilities = StorageCapabilities(
            atomic_rename=False, conditional_put=True, direct_io=False, durable=True, shared=True
        )
        config: dict[str, Any] = {
            "region": options.region,
            "conditional_put": "etag",
            "virtual_hosted_style_request": options.virtual_hosted_style,
            "unsigned_payload": options.unsigned_payload,
        }
        if options.endpoint:
            config["endpoint"] = options.endpoint
        if options.access_key_id is not None:
            config["access_key_id"] = options.access_key_id
            config["secret_access_key"] = options.secret_access_key
            if options.session_token:
                config["session_token"] = options.session_token
        client: dict[str, Any] = {
            "allow_http": options.http_allowed,
            "timeout": _dt.timedelta(seconds=options.timeout_s),
            "connect_timeout": _dt.timedelta(seconds=options.connect_timeout_s),
        }
        retry: dict[str, Any] = {
            "max_retries": options.max_retries,
            "retry_timeout": _dt.timedelta(seconds=options.retry_timeout_s),
            "backoff": {
                "init_backoff": _dt.timedelta(milliseconds=100),
                "max_backoff": _dt.timedelta(seconds=5),
                "base": 2,
            },
        }
        try:
            self._store = S3Store(
                options.bucket,
                prefix=options.prefix or None,
                config=config,  # type: ignore[arg-type]
                client_options=client,  # type: ignore[arg-type]
                retry_config=retry,  # type: ignore[arg-type]
            )
        except (ValueError, TypeError, _obx.BaseError) as exc:
            raise ConfigError(f"cannot configure {self.uri}: {error_summary(str(exc))}") from None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._control: S3Control | None = None
        self._closed = False

    @classmethod
    def from_uri(cls, uri: str, **overrides: Any) -> S3Storage:
        """Open ``s3://bucket/prefix?options`` (see :mod:`tiersave.storage.s3`); ``overrides`` set options."""
        return cls(S3Options.from_uri(uri, **overrides))

    def __repr__(self) -> str:
        return f"S3Storage({self.uri!r}, endpoint={self.options.endpoint!r})"

    # -- errors -----------------------------------------------------------------------------------

    def _errors(self, action: str, key: str) -> contextlib.AbstractContextManager[None]:
        return mapped_errors(self.uri, action, key, self.options)

    def _read_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.read_concurrency, thread_name_prefix="tiersave-s3-get")
            return self._pool

    # -- whole objects ----------------------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        check_key(key)
        view = byte_view(data)
        if mode == "create":
            if len(view) > MAX_SINGLE_PUT_BYTES:
                raise ConfigError(f"create-only put of {key!r} is {len(view)} bytes, over S3's 5 GiB single-PUT limit")
            self._put_create(key, view)
            return
        if mode != "overwrite":
            raise ConfigError(f"put mode must be 'overwrite' or 'create', got {mode!r}")
        with self._errors("writing", key):
            obstore.put(
                self._store,
                key,
                view,
                use_multipart=len(view) > self.options.part_bytes,
                chunk_size=self.options.part_bytes,
                max_concurrency=self.options.upload_concurrency,
            )

    def _put_create(self, key: str, view: memoryview) -> None:
        # 409 ConditionalRequestConflict means a concurrent conditional write was in flight: retry, and the
        # retry settles it (412 if the other writer won). Bounded.
        for attempt in range(4):
            try:
                with self._errors("writing (create-only)", key):
                    obstore.put(self._store, key, view, mode="create", use_multipart=False)
                return
            except PreconditionFailedError:
                if attempt == 3:
                    raise
                time.sleep(0.05 * 2**attempt)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self.get_version(key, max_bytes=max_bytes).data

    def get_version(self, key: str, *, max_bytes: int | None = None) -> VersionedObject:
        """The object's bytes with the ``ETag`` and ``Last-Modified`` of that same response ("" when the
        store sends no ``ETag``)."""
        check_key(key)
        with self._errors("reading", key):
            result = obstore.get(self._store, key)
            meta = result.meta
            size = int(meta["size"])
            if max_bytes is not None and size > max_bytes:
                raise FormatError(f"{key!r} on {self.uri} is {size} bytes, over the {max_bytes}-byte limit", path=key)
            data = bytes(result.bytes())
        if len(data) != size:
            raise CorruptCheckpointError(
                f"{key!r} on {self.uri}: read {len(data)} bytes, the object has {size}", file=key
            )
        return VersionedObject(data, meta["last_modified"].timestamp(), meta.get("e_tag") or "")

    def put_if_version(self, key: str, data: bytes | memoryview, version: str) -> None:
        """Replace ``key`` only while its ``ETag`` is ``version``: a PUT with ``If-Match`` (S3's conditional
        write). PreconditionFailedError when the store answers 412 (changed), 404 (deleted) or, once obstore's
        own retries of it are spent, 409 (another conditional write to the key in flight): in each case
        nothing of this call was written, and the caller reads the object again."""
        check_key(key)
        view = byte_view(data)
        if not version:
            raise ConfigError(f"conditional put of {key!r}: no version to match (the store sent no ETag)")
        if len(view) > MAX_SINGLE_PUT_BYTES:
            raise ConfigError(f"conditional put of {key!r} is {len(view)} bytes, over S3's 5 GiB single-PUT limit")
        with self._errors("writing (if unchanged)", key):
            try:
                obstore.put(self._store, key, view, mode={"e_tag": version}, use_multipart=False)
            except (_obx.PreconditionError, _obx.AlreadyExistsError, _obx.NotFoundError, FileNotFoundError) as exc:
                raise PreconditionFailedError(
                    f"replacing {key!r} on {self.uri}: it is no longer the version read (changed or deleted by "
                    "another writer, or another conditional write was in flight); nothing was written",
                    tier=self.uri,
                    key=key,
                ) from exc

    # -- large objects ----------------------------------------------------------------------------

    def open_writer(self, key: str, *, size_hint: int | None = None) -> S3BlobWriter:
        """Start a new object. The existence check is advisory (S3 cannot make a multipart upload
        create-only here); tiersave writes shards under per-attempt prefixes, so keys never collide.
        ``size_hint`` is accepted for the protocol; parts are uploaded as they fill, so it is not needed."""
        check_key(key)
        if self.exists(key):
            raise AlreadyExistsError(f"{key!r} already exists on {self.uri}", tier=self.uri, key=key)
        return S3BlobWriter(self._store, key, options=self.options, control=self._control_client)

    def open_reader(self, key: str) -> S3BlobReader:
        info = self.head(key)
        return S3BlobReader(self._store, key, info.size, options=self.options, pool=self._read_pool)

    # -- metadata ---------------------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        check_key(key)
        with self._errors("inspecting", key):
            meta = obstore.head(self._store, key)
        return ObjectInfo(key, int(meta["size"]), meta["last_modified"].timestamp())

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_key(prefix, allow_empty=True)
        with self._errors("listing", prefix):
            stream = obstore.list(self._store, prefix or None, chunk_size=1000)
            for batch in stream:
                for meta in batch:
                    yield ObjectInfo(str(meta["path"]), int(meta["size"]), meta["last_modified"].timestamp())

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        check_key(prefix, allow_empty=True)
        with self._errors("listing", prefix):
            result = obstore.list_with_delimiter(self._store, prefix or None)
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in result["common_prefixes"])

    # -- deletion ---------------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        check_key(key)
        with self._errors("deleting", key):
            obstore.delete(self._store, key)

    def delete_prefix(self, prefix: str) -> None:
        """Delete the object ``prefix`` and every object under ``prefix/`` (bulk deletes of 1000).

        Not atomic: a crash leaves some objects, which a retry or ``prune`` removes. Unfinished multipart
        uploads are not touched (see :meth:`abort_multipart_uploads`)."""
        check_key(prefix)
        keys = [info.key for info in self.list(prefix)]
        if self.exists(prefix):
            keys.append(prefix)
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            with self._errors("deleting", prefix):
                obstore.delete(self._store, batch)

    def rename_prefix(self, src: str, dst: str) -> None:
        raise ConfigError(f"{self.uri} has no atomic rename (object store); commit with tiersave.commit.MarkerCommit")

    # -- multipart housekeeping -------------------------------------------------------------------

    def _control_client(self) -> S3Control:
        if self._control is None:
            self._control = S3Control(self.options)
        return self._control

    def list_multipart_uploads(self, prefix: str = "") -> builtins.list[MultipartUpload]:
        """Unfinished multipart uploads whose key lies under ``prefix`` (relative keys).

        Needs static credentials (URI or environment). Raises :class:`ConfigError` without them."""
        check_key(prefix, allow_empty=True)
        return self._control_client().list_uploads(prefix)

    def abort_multipart_uploads(self, prefix: str = "", *, older_than_s: float | None = None) -> builtins.list[str]:
        """Abort unfinished multipart uploads under ``prefix``; returns the keys aborted.

        Uploads left by a crashed writer are invisible but their parts are stored (and billed) until
        aborted. Args:
            prefix: relative key prefix ("" for the whole storage).
            older_than_s: only uploads started at least this long ago (leave a live writer alone).
        """
        now = time.time()
        aborted = []
        for upload in self.list_multipart_uploads(prefix):
            if older_than_s is not None and now - upload.initiated < older_than_s:
                continue
            self._control_client().abort_upload(upload.key, upload.upload_id)
            aborted.append(upload.key)
        return aborted

    def writer_lock(self) -> Lease:
        """Take this root's writer lock: a lease object with a heartbeat (:mod:`tiersave.storage.s3.lease`).

        Raises:
            WriterLockedError: another writer's unexpired lease holds it, named in the message.
        """
        return Lease(self)

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for tests and first-time setup)."""
        self._control_client().create_bucket()

    def close(self) -> None:
        """Release the read threads. Idempotent."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
            self._closed = True
        if pool is not None:
            pool.shutdown(wait=True)
