"""S3-compatible object storage (AWS S3, SeaweedFS, MinIO, Ceph RGW, R2...) through obstore.

Scope: the :class:`~tiersave.storage.base.Storage` protocol on a bucket prefix: whole-object puts (with a
create-only mode, ``If-None-Match: *``), shard writers that turn out-of-order ``write_at`` calls into one
parallel multipart upload with bounded memory, shard readers that split large ranged reads into parallel
GETs, listing, deletion, and the housekeeping obstore does not offer (listing and aborting unfinished
multipart uploads). Anti-scope: the commit protocol (``tiersave.commit.MarkerCommit``), checksums.

URI::

    s3://BUCKET[/PREFIX][?OPTION=VALUE&...]

Options (all optional): ``endpoint`` (e.g. ``http://127.0.0.1:8333``), ``region``, ``access_key_id``,
``secret_access_key``, ``session_token``, ``allow_http`` (default: true when the endpoint is ``http://``),
``virtual_hosted_style`` (default false: path-style requests), ``unsigned_payload`` (default true),
``part_size`` (default ``16MiB``, at least ``5MiB``), ``upload_concurrency`` (parts in flight per object,
default 8), ``read_part_size`` (default ``16MiB``), ``read_concurrency`` (default 8),
``write_buffer`` (bytes one writer may buffer, default ``256MiB``), ``retries`` (per request, default 5),
``retry_timeout`` (default ``60s``), ``timeout`` (per request, default ``60s``), ``connect_timeout``
(default ``5s``). Whatever the URI leaves out comes from the standard AWS environment variables:
``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN`` (obstore also finds instance/container credentials).
Prefer the environment for secrets: URIs end up in logs and shell history. ``S3Storage.uri`` never
contains the query string.

Why obstore, and why a little SigV4 of our own: on the same SeaweedFS server obstore's multipart upload
used about 5x less client CPU per byte than boto3's (0.33 vs 1.7 s/GB, with unsigned payloads), which
matters when the client shares the cores with training; download throughput was the same. obstore 0.12
has no call to list or abort multipart uploads, so :class:`_S3Control` signs those few requests itself
(static credentials only).

Thread safety: one ``S3Storage`` serves any number of threads. Atomicity: a put, and a writer's object,
become visible whole or not at all (S3 never exposes a partial object; a multipart upload is invisible
until completed). Errors: every obstore or HTTP error is mapped to :mod:`tiersave.errors` in
:func:`map_s3_error`, the one place for this backend.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as _dt
import hashlib
import hmac
import http.client
import logging
import os
import re
import ssl
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

from ..._futures import wait_all
from ...errors import (
    AlreadyExistsError,
    BackendUnavailableError,
    ConfigError,
    CorruptCheckpointError,
    FormatError,
    ObjectNotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StorageError,
    TiersaveError,
    TransientStorageError,
)
from ..base import ObjectInfo, PutMode, StorageCapabilities, check_key

try:
    import obstore
    from obstore import exceptions as _obx
    from obstore.store import S3Store
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise BackendUnavailableError("the s3:// tier needs obstore: pip install 'tiersave[s3]'") from _exc

log = logging.getLogger(__name__)

__all__ = ["MultipartUpload", "S3Options", "S3Storage", "map_s3_error"]

MIN_PART_BYTES = 5 << 20
"""S3's smallest part (every part of a multipart upload but the last)."""
MAX_PARTS = 10_000
"""S3's largest part count: an object may hold at most ``MAX_PARTS * part_bytes`` bytes."""
MAX_SINGLE_PUT_BYTES = 5 << 30

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


# ------------------------------------------------------------------------------------------------ options


@dataclass(frozen=True, kw_only=True)
class S3Options:
    """Where an :class:`S3Storage` lives and how it talks to it. See the module docstring for the URI.

    Attributes:
        bucket: bucket name.
        prefix: key prefix inside the bucket ("" for the bucket root), without leading or trailing ``/``.
        endpoint: service URL; None means AWS (``https://s3.<region>.amazonaws.com``).
        region: signing region.
        access_key_id, secret_access_key, session_token: static credentials; None lets obstore find
            credentials itself (instance profile, container, web identity).
        allow_http: permit ``http://`` endpoints.
        virtual_hosted_style: ``bucket.host`` requests instead of ``host/bucket``.
        unsigned_payload: sign headers only, not the body hash (saves ~1 s of CPU per GB; the manifest's
            CRC-32C still covers every byte).
        part_bytes: multipart part size, >= 5 MiB; objects may hold ``10_000 * part_bytes`` bytes.
        upload_concurrency: parts of one object uploaded at once.
        read_part_bytes: a ranged read larger than this is split into parallel GETs of this size.
        read_concurrency: parallel GETs per storage.
        write_buffer_bytes: bytes one writer may hold before ``write_at`` blocks (back-pressure).
        max_retries: retries of one request on 5xx, throttling and connection errors (with backoff).
        retry_timeout_s: no retry starts after this many seconds from the first attempt.
        timeout_s: limit for one request.
        connect_timeout_s: limit for connecting.
    """

    bucket: str
    prefix: str = ""
    endpoint: str | None = None
    region: str = "us-east-1"
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    allow_http: bool | None = None
    virtual_hosted_style: bool = False
    unsigned_payload: bool = True
    part_bytes: int = 16 << 20
    upload_concurrency: int = 8
    read_part_bytes: int = 16 << 20
    read_concurrency: int = 8
    write_buffer_bytes: int = 256 << 20
    max_retries: int = 5
    retry_timeout_s: float = 60.0
    timeout_s: float = 60.0
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not _BUCKET_RE.match(self.bucket) or ".." in self.bucket:
            raise ConfigError(f"invalid S3 bucket name {self.bucket!r} (3-63 of a-z, 0-9, '.', '-')")
        if self.prefix:
            check_key(self.prefix)
        if self.endpoint is not None and not re.match(r"^https?://[^/?#]+/?$", self.endpoint):
            raise ConfigError(f"S3 endpoint must look like http(s)://host[:port], got {self.endpoint!r}")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError("S3 credentials need both access_key_id and secret_access_key")
        if not isinstance(self.part_bytes, int) or self.part_bytes < MIN_PART_BYTES:
            raise ConfigError(f"S3 part_size must be at least 5 MiB, got {self.part_bytes!r}")
        for name in ("upload_concurrency", "read_concurrency", "read_part_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"S3 option {name} must be a positive integer, got {value!r}")
        if not isinstance(self.write_buffer_bytes, int) or self.write_buffer_bytes < 2 * self.part_bytes:
            raise ConfigError(
                f"S3 write_buffer must hold at least two parts ({2 * self.part_bytes} bytes), "
                f"got {self.write_buffer_bytes!r}"
            )
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ConfigError(f"S3 retries must be a non-negative integer, got {self.max_retries!r}")
        for name in ("retry_timeout_s", "timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"S3 option {name} must be positive, got {getattr(self, name)!r}")

    @property
    def uri(self) -> str:
        """``s3://bucket/prefix``: names the tier in messages; holds no option and no secret."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def http_allowed(self) -> bool:
        if self.allow_http is not None:
            return self.allow_http
        return bool(self.endpoint and self.endpoint.startswith("http://"))

    @classmethod
    def from_uri(cls, uri: str, *, env: Mapping[str, str] | None = None, **overrides: Any) -> S3Options:
        """Parse ``s3://bucket/prefix?option=value``; fill the rest from the AWS environment variables.

        Args:
            uri: the URI (options as in the module docstring).
            env: the environment to read (default ``os.environ``).
            overrides: field values that win over both the URI and the environment.

        Raises:
            ConfigError: a malformed URI, an unknown option or a bad value.
        """
        from ...units import parse_bytes, parse_duration

        environ = os.environ if env is None else env
        parsed = urllib.parse.urlsplit(uri)
        if parsed.scheme.lower() != "s3":
            raise ConfigError(f"not an s3:// URI: {uri!r}")
        if parsed.username is not None or parsed.password is not None:
            raise ConfigError(
                "put S3 credentials in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or in the access_key_id and "
                "secret_access_key options, not in the URI's user part"
            )
        bucket = parsed.netloc
        prefix = urllib.parse.unquote(parsed.path).strip("/")
        try:
            query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True, strict_parsing=bool(parsed.query))
        except ValueError:
            raise ConfigError(f"malformed query in S3 URI {cls._redact(uri)!r}") from None
        values: dict[str, Any] = {"bucket": bucket, "prefix": prefix}
        for key, items in query.items():
            if len(items) != 1:
                raise ConfigError(f"S3 URI option {key!r} given {len(items)} times")
            text = items[0]
            spec = _URI_OPTIONS.get(key)
            if spec is None:
                raise ConfigError(f"unknown S3 URI option {key!r}; known: {', '.join(sorted(_URI_OPTIONS))}")
            name, kind = spec
            try:
                if kind == "bytes":
                    values[name] = parse_bytes(text)
                elif kind == "int":
                    values[name] = int(text)
                elif kind == "duration":
                    values[name] = parse_duration(text)
                elif kind == "bool":
                    values[name] = _parse_bool(text, key)
                else:
                    values[name] = text
            except ValueError:
                raise ConfigError(f"S3 URI option {key}={text!r} is not a valid {kind}") from None
        values.setdefault(
            "endpoint",
            environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL") or environ.get("AWS_ENDPOINT"),
        )
        values.setdefault("region", environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION") or "us-east-1")
        if "access_key_id" not in values and "secret_access_key" not in values:
            values["access_key_id"] = environ.get("AWS_ACCESS_KEY_ID") or None
            values["secret_access_key"] = environ.get("AWS_SECRET_ACCESS_KEY") or None
            values.setdefault("session_token", environ.get("AWS_SESSION_TOKEN") or None)
        if values.get("endpoint") is not None:
            values["endpoint"] = str(values["endpoint"]).rstrip("/")
        values.update(overrides)
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ConfigError(f"unknown S3 option(s): {', '.join(sorted(unknown))}")
        return cls(**values)

    @staticmethod
    def _redact(uri: str) -> str:
        return re.sub(r"(secret_access_key|session_token)=[^&]*", r"\1=***", uri)


_URI_OPTIONS: dict[str, tuple[str, str]] = {
    "endpoint": ("endpoint", "str"),
    "region": ("region", "str"),
    "access_key_id": ("access_key_id", "str"),
    "secret_access_key": ("secret_access_key", "str"),
    "session_token": ("session_token", "str"),
    "allow_http": ("allow_http", "bool"),
    "virtual_hosted_style": ("virtual_hosted_style", "bool"),
    "unsigned_payload": ("unsigned_payload", "bool"),
    "part_size": ("part_bytes", "bytes"),
    "upload_concurrency": ("upload_concurrency", "int"),
    "read_part_size": ("read_part_bytes", "bytes"),
    "read_concurrency": ("read_concurrency", "int"),
    "write_buffer": ("write_buffer_bytes", "bytes"),
    "retries": ("max_retries", "int"),
    "retry_timeout": ("retry_timeout_s", "duration"),
    "timeout": ("timeout_s", "duration"),
    "connect_timeout": ("connect_timeout_s", "duration"),
}


def _parse_bool(text: str, key: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"S3 URI option {key}={text!r} must be true or false")


# ------------------------------------------------------------------------------------------ error mapping

_STATUS_RE = re.compile(r"status(?: code)?:? (\d{3})", re.IGNORECASE)
_CODE_RE = re.compile(r"<Code>([A-Za-z0-9]+)</Code>")
_NETWORK_WORDS = (
    "error sending request",
    "connection",
    "connect error",
    "timed out",
    "timeout",
    "broken pipe",
    "reset by peer",
    "incomplete",
    "error decoding response body",
    "unexpected eof",
    "http error",
)


def _summary(text: str) -> str:
    first = text.strip().split("\n", 1)[0]
    first = re.sub(r"<\?xml.*", "", first).strip().rstrip(":")
    return first[:300]


def _is_transient(exc: BaseException, status: int | None, lowered: str) -> bool:
    if status is not None:
        return status >= 500 or status in (408, 429)
    return isinstance(exc, (ConnectionError, TimeoutError)) or any(w in lowered for w in _NETWORK_WORDS)


def map_s3_error(
    exc: BaseException, *, tier: str, key: str, action: str, status: int | None = None, body: str = ""
) -> StorageError:
    """Map an obstore exception, or an HTTP status of our own request, to a :class:`StorageError`.

    This is the one place where this backend's native errors become tiersave's; messages name the tier,
    the key, the action and the S3 error code.

    Args:
        exc: the native error (an ``obstore.exceptions`` error, ``OSError``...).
        tier: the storage URI.
        key: the key relative to the storage root.
        action: what was being done (``"writing"``), for the message.
        status: the HTTP status when known (requests made by :class:`_S3Control`).
        body: the response body when known.
    """
    if isinstance(exc, StorageError):
        return exc
    text = f"{exc}\n{body}"
    if status is None:
        match = _STATUS_RE.search(text)
        status = int(match.group(1)) if match else None
    code_match = _CODE_RE.search(text)
    code = code_match.group(1) if code_match else ""
    lowered = text.lower()
    detail = " ".join(
        part for part in (f"HTTP {status}" if status else "", code, "" if status else _summary(str(exc))) if part
    )
    message = f"{action} {key!r} on {tier} failed: {detail or type(exc).__name__}"
    cls: type[StorageError]
    if code == "NoSuchBucket":
        cls = ObjectNotFoundError
        message += " (the bucket does not exist)"
    elif isinstance(exc, (_obx.NotFoundError, FileNotFoundError)) or status == 404:
        cls = ObjectNotFoundError
    elif isinstance(exc, _obx.AlreadyExistsError) or status == 412:
        cls = AlreadyExistsError
        message += " (a create-only write found the key taken; nothing was overwritten)"
    elif isinstance(exc, _obx.PreconditionError) or status == 409:
        cls = PreconditionFailedError
    elif isinstance(exc, (_obx.PermissionDeniedError, _obx.UnauthenticatedError)) or status in (401, 403):
        cls = PermissionDeniedError
    elif _is_transient(exc, status, lowered):
        cls = TransientStorageError
    else:
        cls = StorageError
    return cls(message, tier=tier, key=key)


# ------------------------------------------------------------------------------------------------ storage


@dataclass(frozen=True)
class MultipartUpload:
    """An unfinished multipart upload, as listed by :meth:`S3Storage.list_multipart_uploads`.

    Attributes:
        key: the object key relative to the storage root.
        upload_id: the service's id of the upload.
        initiated: when the upload started (seconds since the epoch).
    """

    key: str
    upload_id: str
    initiated: float


class S3Storage:
    """A bucket prefix on an S3-compatible service. See the module docstring for URIs and guarantees.

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
            raise ConfigError(f"cannot configure {self.uri}: {_summary(str(exc))}") from None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._control: _S3Control | None = None
        self._closed = False

    @classmethod
    def from_uri(cls, uri: str, **overrides: Any) -> S3Storage:
        """Open ``s3://bucket/prefix?options`` (see the module docstring); ``overrides`` set options."""
        return cls(S3Options.from_uri(uri, **overrides))

    def __repr__(self) -> str:
        return f"S3Storage({self.uri!r}, endpoint={self.options.endpoint!r})"

    # -- errors -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, action: str, key: str) -> Iterator[None]:
        try:
            yield
        except TiersaveError:
            raise
        except Exception as exc:
            raise map_s3_error(exc, tier=self.uri, key=key, action=action) from exc

    def _read_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.read_concurrency, thread_name_prefix="tiersave-s3-get")
            return self._pool

    # -- whole objects ----------------------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = "overwrite") -> None:
        check_key(key)
        view = _byte_view(data)
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
        check_key(key)
        with self._errors("reading", key):
            result = obstore.get(self._store, key)
            size = int(result.meta["size"])
            if max_bytes is not None and size > max_bytes:
                raise FormatError(f"{key!r} on {self.uri} is {size} bytes, over the {max_bytes}-byte limit", path=key)
            data = bytes(result.bytes())
        if len(data) != size:
            raise CorruptCheckpointError(
                f"{key!r} on {self.uri}: read {len(data)} bytes, the object has {size}", file=key
            )
        return data

    # -- large objects ----------------------------------------------------------------------------

    def open_writer(self, key: str) -> S3BlobWriter:
        """Start a new object. The existence check is advisory (S3 cannot make a multipart upload
        create-only here); tiersave writes shards under per-attempt prefixes, so keys never collide."""
        check_key(key)
        if self.exists(key):
            raise AlreadyExistsError(f"{key!r} already exists on {self.uri}", tier=self.uri, key=key)
        return S3BlobWriter(self, key)

    def open_reader(self, key: str) -> S3BlobReader:
        info = self.head(key)
        return S3BlobReader(self, key, info.size)

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

    def _control_client(self) -> _S3Control:
        if self._control is None:
            self._control = _S3Control(self.options)
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


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


# ------------------------------------------------------------------------------------------------ reader


class S3BlobReader:
    """Ranged reads of one object. A read larger than ``read_part_bytes`` is split into parallel GETs.

    Thread safety: ``read_into`` may be called from many threads at once.
    """

    def __init__(self, storage: S3Storage, key: str, size: int) -> None:
        self.key = key
        self.size = size
        self._storage = storage

    def read_into(self, offset: int, out: memoryview) -> None:
        view = _byte_view(out)
        end = offset + len(view)
        if offset < 0 or end > self.size:
            raise CorruptCheckpointError(
                f"{self.key!r} on {self._storage.uri} ends at byte {self.size}, before byte {end}", file=self.key
            )
        step = self._storage.options.read_part_bytes
        if len(view) <= step:
            self._fetch(offset, view)
            return
        pool = self._storage._read_pool()
        futures: list[Future[None]] = [
            pool.submit(self._fetch, offset + start, view[start : start + step]) for start in range(0, len(view), step)
        ]
        wait_all(futures)

    def _fetch(self, offset: int, view: memoryview) -> None:
        if not view:
            return
        storage = self._storage
        with storage._errors("reading", self.key):
            data = obstore.get_range(storage._store, self.key, start=offset, length=len(view))
        got = memoryview(data)
        if len(got) != len(view):
            raise CorruptCheckpointError(
                f"{self.key!r} on {storage.uri}: bytes {offset}..{offset + len(view)} returned {len(got)} bytes "
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


# ------------------------------------------------------------------------------------------------ writer


class _Block:
    """One part being assembled. ``buf`` may be recycled (dirty): bytes never written are zeroed only
    when a partial block is handed over (``zero_gaps``), so a full block costs no extra pass."""

    __slots__ = ("buf", "filled", "spans")

    def __init__(self, buf: bytearray) -> None:
        self.buf = buf
        self.filled = 0
        self.spans: list[tuple[int, int]] = []

    def zero_gaps(self, length: int) -> None:
        buf, zeros = memoryview(self.buf), memoryview(_zeros(len(self.buf)))
        cursor = 0
        for lo, hi in sorted(self.spans):
            if lo > cursor:
                buf[cursor:lo] = zeros[: lo - cursor]
            cursor = max(cursor, hi)
        if cursor < length:
            buf[cursor:length] = zeros[: length - cursor]


_ZEROS: dict[int, bytes] = {}


def _zeros(size: int) -> bytes:
    block = _ZEROS.get(size)
    if block is None:
        block = _ZEROS[size] = bytes(size)
    return block


class _Aborted(Exception):
    """Raised inside the part iterator to make obstore abandon (and abort) the multipart upload."""


class S3BlobWriter:
    """One object written with ``write_at`` from many threads, uploaded as one multipart upload.

    Writes are copied into part-sized blocks; a block whose every byte was written, and all before it,
    is handed to obstore's multipart upload (``upload_concurrency`` parts in flight). Memory is bounded:
    a ``write_at`` starting ``write_buffer_bytes`` or more past the first block not yet handed over waits
    (back-pressure), so at most ``write_buffer_bytes`` plus one write are buffered. A write at the first
    missing byte never waits, so writers that issue their writes roughly in offset order (as the tiersave
    engines do, from a FIFO pool) cannot deadlock. ``finish`` fills gaps with zeros. An object that fits in
    one part is sent with a single PUT.

    Call protocol: ``write_at`` (any threads, disjoint ranges) -> ``finish(size)`` once, after every write
    returned; ``abort()`` any time, idempotent. Nothing is visible before ``finish`` returns.
    """

    def __init__(self, storage: S3Storage, key: str) -> None:
        self.key = key
        self._storage = storage
        opts = storage.options
        self._part = opts.part_bytes
        self._window = opts.write_buffer_bytes
        self._max_bytes = MAX_PARTS * self._part
        self._cond = threading.Condition()
        self._blocks: dict[int, _Block] = {}
        self._next = 0  # first block not yet handed to the upload
        self._size: int | None = None  # set by finish
        self._state = "open"  # open | finishing | done | aborted | failed
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._sent: list[tuple[bytearray, memoryview]] = []  # handed to obstore; reusable once released
        self._max_sent = max(2, self._window // self._part)

    # -- producer side ----------------------------------------------------------------------------

    def write_at(self, offset: int, data: memoryview) -> None:
        view = _byte_view(data)
        if not view:
            return
        end = offset + len(view)
        if offset < 0:
            raise ConfigError(f"{self.key!r}: negative offset {offset}")
        if end > self._max_bytes:
            raise ConfigError(
                f"{self.key!r} on {self._storage.uri}: byte {end} is past the {MAX_PARTS}-part limit of "
                f"{self._max_bytes} bytes at part_size={self._part}; raise part_size or lower max_shard_bytes"
            )
        part = self._part
        first, last = offset // part, (end - 1) // part
        with self._cond:
            while True:
                self._check_writable()
                if offset < self._next * part + self._window:
                    break
                self._cond.wait()
            if first < self._next:
                raise StorageError(
                    f"{self.key!r}: write at byte {offset} after that part was uploaded (overlapping writes?)",
                    tier=self._storage.uri,
                    key=self.key,
                )
            blocks = []
            for index in range(first, last + 1):
                block = self._blocks.get(index)
                if block is None:
                    block = self._blocks[index] = _Block(self._new_buffer())
                blocks.append(block)
        # Copy outside the lock: blocks are not handed over before their bytes are counted below.
        spans = []
        for index, block in zip(range(first, last + 1), blocks):
            lo = max(offset, index * part)
            hi = min(end, (index + 1) * part)
            # memoryview slice assignment is a plain memcpy; bytearray slice assignment is ~15x slower.
            memoryview(block.buf)[lo - index * part : hi - index * part] = view[lo - offset : hi - offset]
            spans.append((block, lo - index * part, hi - index * part))
        with self._cond:
            for block, lo, hi in spans:
                block.filled += hi - lo
                block.spans.append((lo, hi))
            self._cond.notify_all()
            start_upload = self._thread is None and self._state == "open" and self._full(0)
            if start_upload:
                self._start_upload()

    def _new_buffer(self) -> bytearray:
        """A part buffer: a recycled one if any (fresh pages cost a page fault each), else a new one.

        obstore sends parts zero-copy: it holds the buffer we yielded until that part's upload is done.
        ``memoryview.release()`` fails while anyone still holds a buffer from the view, so a buffer is
        reused only after obstore let go of it.
        """
        for i, (buf, view) in enumerate(self._sent):
            try:
                view.release()
            except BufferError:
                continue  # still being uploaded
            del self._sent[i]
            return buf
        return bytearray(self._part)

    def _check_writable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._state != "open":
            raise StorageError(
                f"{self.key!r}: write after finish/abort ({self._state})", tier=self._storage.uri, key=self.key
            )

    def _full(self, index: int) -> bool:
        block = self._blocks.get(index)
        return block is not None and block.filled >= self._part

    def _start_upload(self) -> None:
        thread = threading.Thread(target=self._upload, name=f"tiersave-s3-put:{self.key}", daemon=True)
        self._thread = thread
        thread.start()

    # -- consumer side (the upload thread) --------------------------------------------------------

    def _parts(self) -> Iterator[memoryview]:
        part = self._part
        while True:
            with self._cond:
                while True:
                    if self._state == "aborted":
                        raise _Aborted
                    index = self._next
                    if self._size is not None:
                        nblocks = -(-self._size // part)
                        if index >= nblocks:
                            return
                        block = self._blocks.pop(index, None)
                        length = min(part, self._size - index * part)
                        if block is None:
                            buf = bytearray(part)
                        else:
                            if block.filled < part:
                                block.zero_gaps(length)
                            buf = block.buf
                        break
                    if self._full(index):
                        buf = self._blocks.pop(index).buf
                        length = part
                        break
                    self._cond.wait()
                self._next = index + 1
                self._cond.notify_all()  # the window moved: waiting writers may go on
            view = memoryview(buf)[:length]
            yield view
            if len(buf) == part:
                with self._cond:
                    if len(self._sent) < self._max_sent:
                        self._sent.append((buf, view))

    def _upload(self) -> None:
        opts = self._storage.options
        try:
            obstore.put(
                self._storage._store,
                self.key,
                self._parts(),
                use_multipart=True,
                chunk_size=self._part,
                max_concurrency=opts.upload_concurrency,
            )
        except BaseException as exc:
            with self._cond:
                if self._state != "aborted":
                    self._error = (
                        exc
                        if isinstance(exc, TiersaveError)
                        else map_s3_error(exc, tier=self._storage.uri, key=self.key, action="uploading")
                    )
                    self._state = "failed"
                self._blocks.clear()
                self._cond.notify_all()

    # -- end --------------------------------------------------------------------------------------

    def finish(self, size: int) -> None:
        if not isinstance(size, int) or size < 0 or size > self._max_bytes:
            raise ConfigError(f"{self.key!r}: invalid final size {size!r}")
        with self._cond:
            self._check_writable()
            self._size = size
            self._state = "finishing"
            self._cond.notify_all()
            thread = self._thread
            if thread is None and size > self._part:
                self._start_upload()
                thread = self._thread
            small = None
            if thread is None:
                block = self._blocks.pop(0, None)
                if block is not None and block.filled < self._part:
                    block.zero_gaps(size)
                small = memoryview(block.buf)[:size] if block is not None else memoryview(bytearray(size))
        if small is not None:
            try:
                with self._storage._errors("writing", self.key):
                    obstore.put(self._storage._store, self.key, small, use_multipart=False)
            except BaseException:
                with self._cond:
                    self._state = "failed"
                raise
        elif thread is not None:
            thread.join()
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._state == "aborted":
                raise StorageError(f"{self.key!r}: aborted during finish", tier=self._storage.uri, key=self.key)
            self._state = "done"
            self._sent = []
            self._blocks.clear()  # writes past ``size``, if any, were cut off

    def abort(self) -> None:
        with self._cond:
            previous = self._state
            self._state = "aborted"
            self._blocks.clear()
            self._sent = []
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # obstore abandons the upload and sends AbortMultipartUpload when the part iterator raises.
            thread.join(self._storage.options.timeout_s * 2 + self._storage.options.retry_timeout_s)
        if previous in ("done", "aborted"):
            if previous == "done":
                with contextlib.suppress(ObjectNotFoundError):
                    self._storage.delete(self.key)
            return
        if thread is not None and previous in ("failed", "finishing", "open"):
            # If obstore's own abort could not reach the service, make one more attempt (best effort).
            try:
                for upload in self._storage.list_multipart_uploads(self.key):
                    if upload.key == self.key:
                        self._storage._control_client().abort_upload(upload.key, upload.upload_id)
            except (ConfigError, StorageError) as exc:
                log.debug("could not check for a leftover upload of %s: %s", self.key, exc)


# --------------------------------------------------------------------------- requests obstore cannot make

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_MAX_RESPONSE_BYTES = 16 << 20


class _S3Control:
    """The few S3 requests obstore 0.12 lacks (list/abort multipart uploads, create bucket), signed with
    AWS Signature Version 4 over ``http.client``. Static credentials only; one connection per request.

    Thread safety: stateless apart from the options; any thread may call it.
    """

    def __init__(self, options: S3Options) -> None:
        if options.access_key_id is None or options.secret_access_key is None:
            raise ConfigError(
                f"{options.uri}: listing and aborting multipart uploads needs static credentials "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the URI's access_key_id/secret_access_key)"
            )
        self.options = options
        endpoint = options.endpoint or f"https://s3.{options.region}.amazonaws.com"
        parts = urllib.parse.urlsplit(endpoint)
        if parts.scheme == "http" and not options.http_allowed:
            raise ConfigError(f"{options.uri}: endpoint {endpoint} is http:// but allow_http is false")
        self._https = parts.scheme == "https"
        self._host = parts.netloc
        if options.virtual_hosted_style:
            self._host = f"{options.bucket}.{parts.netloc}"
            self._base = ""
        else:
            self._base = "/" + options.bucket
        self._prefix = options.prefix

    def _full_key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix and key else (self._prefix or key)

    def _relative(self, key: str) -> str | None:
        if not self._prefix:
            return key
        head = self._prefix + "/"
        return key[len(head) :] if key.startswith(head) else None

    def request(
        self,
        method: str,
        key: str,
        query: Mapping[str, str],
        *,
        action: str,
        ok: tuple[int, ...] = (200, 204),
        retries: int | None = None,
    ) -> tuple[int, bytes]:
        path = self._base + "/" + urllib.parse.quote(key, safe="/-_.~") if key else (self._base or "/")
        now = _dt.datetime.now(_dt.timezone.utc)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        date = amz_date[:8]
        canonical_query = "&".join(
            f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
            for k, v in sorted(query.items())
        )
        payload_hash = hashlib.sha256(b"").hexdigest()
        headers = {"host": self._host, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
        if self.options.session_token:
            headers["x-amz-security-token"] = self.options.session_token
        signed = ";".join(sorted(headers))
        canonical_headers = "".join(f"{k}:{headers[k]}\n" for k in sorted(headers))
        canonical = "\n".join([method, path, canonical_query, canonical_headers, signed, payload_hash])
        scope = f"{date}/{self.options.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        secret = self.options.secret_access_key or ""
        k = hmac.new(("AWS4" + secret).encode(), date.encode(), hashlib.sha256).digest()
        for part in (self.options.region, "s3", "aws4_request"):
            k = hmac.new(k, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(k, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.options.access_key_id}/{scope}, "
            f"SignedHeaders={signed}, Signature={signature}"
        )
        target = path + ("?" + canonical_query if canonical_query else "")
        last: BaseException | None = None
        attempts = (self.options.max_retries if retries is None else retries) + 1
        for attempt in range(attempts):
            conn: http.client.HTTPConnection
            if self._https:
                conn = http.client.HTTPSConnection(
                    self._host, timeout=self.options.timeout_s, context=ssl.create_default_context()
                )
            else:
                conn = http.client.HTTPConnection(self._host, timeout=self.options.timeout_s)
            try:
                conn.request(method, target, headers=headers)
                response = conn.getresponse()
                body = response.read(_MAX_RESPONSE_BYTES + 1)
                status = response.status
            except (OSError, http.client.HTTPException) as exc:
                last = exc
                status, body = 0, b""
            finally:
                conn.close()
            if status in ok:
                return status, body
            if status and status < 500 and status not in (408, 429):
                break
            if attempt + 1 < attempts:
                time.sleep(min(5.0, 0.1 * 2**attempt))
        error = last or StorageError(f"HTTP {status}")
        text = body[:4096].decode("utf-8", "replace")
        raise map_s3_error(
            error,
            tier=self.options.uri,
            key=self._relative(key) or key,
            action=action,
            status=status or None,
            body=text,
        )

    def list_uploads(self, prefix: str) -> list[MultipartUpload]:
        full = self._full_key(prefix)
        # S3 prefixes are plain string prefixes: ask for ``full`` and keep the key itself and keys below it.
        query = {"uploads": ""}
        if full:
            query["prefix"] = full if prefix else full + "/"
        out: dict[tuple[str, str], MultipartUpload] = {}
        marker: dict[str, str] = {}
        while True:
            _, body = self.request("GET", "", {**query, **marker}, action="listing uploads")
            root = _parse_xml(body, self.options.uri)
            for upload in root.iter(f"{_NS}Upload"):
                key = upload.findtext(f"{_NS}Key") or ""
                upload_id = upload.findtext(f"{_NS}UploadId") or ""
                rel = self._relative(key)
                if rel is None or not upload_id:
                    continue
                if prefix and rel != prefix and not rel.startswith(prefix + "/"):
                    continue
                out[(rel, upload_id)] = MultipartUpload(rel, upload_id, _parse_time(upload.findtext(f"{_NS}Initiated")))
            if (root.findtext(f"{_NS}IsTruncated") or "").lower() != "true":
                break
            next_key = root.findtext(f"{_NS}NextKeyMarker") or ""
            if not next_key:
                break
            marker = {"key-marker": next_key, "upload-id-marker": root.findtext(f"{_NS}NextUploadIdMarker") or ""}
        return sorted(out.values(), key=lambda u: (u.key, u.upload_id))

    def abort_upload(self, key: str, upload_id: str, *, retries: int | None = None) -> None:
        self.request(
            "DELETE",
            self._full_key(key),
            {"uploadId": upload_id},
            action="aborting upload of",
            ok=(200, 204, 404),
            retries=retries,
        )

    def create_bucket(self) -> None:
        status, body = self.request("PUT", "", {}, action="creating bucket", ok=(200, 409))
        if status == 409 and b"BucketAlreadyOwnedByYou" not in body:
            text = body[:4096].decode("utf-8", "replace")
            raise map_s3_error(
                StorageError("conflict"), tier=self.options.uri, key="", action="creating bucket", status=409, body=text
            )


def _parse_xml(body: bytes, tier: str) -> ET.Element:
    if len(body) > _MAX_RESPONSE_BYTES:
        raise StorageError(f"{tier}: listing response over {_MAX_RESPONSE_BYTES} bytes", tier=tier)
    try:
        return ET.fromstring(body)
    except ET.ParseError as exc:
        raise StorageError(f"{tier}: malformed XML from the service: {exc}", tier=tier) from None


def _parse_time(text: str | None) -> float:
    if not text:
        return 0.0
    try:
        return _dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
