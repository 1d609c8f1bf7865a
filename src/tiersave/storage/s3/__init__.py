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
has no call to list or abort multipart uploads, so :class:`~tiersave.storage.s3.control.S3Control` signs those few
requests itself
(static credentials only).

Thread safety: one ``S3Storage`` serves any number of threads. Atomicity: a put, and a writer's object,
become visible whole or not at all (S3 never exposes a partial object; a multipart upload is invisible
until completed). Errors: every obstore or HTTP error is mapped to :mod:`tiersave.errors` in
:func:`map_s3_error` (``errors.py``), the one place for this backend.

Modules, one concern each:

- ``options.py``: :class:`S3Options`, the URI and environment parsing, S3's size limits;
- ``errors.py``: :func:`map_s3_error`, native errors -> :mod:`tiersave.errors`;
- ``store.py``: :class:`S3Storage`, the ``Storage`` protocol on the obstore client;
- ``reader.py``: :class:`S3BlobReader`, ranged reads split into parallel GETs;
- ``writer.py``: :class:`S3BlobWriter`, out-of-order writes -> one multipart upload with bounded memory;
- ``lease.py``: :class:`Lease`, the writer lock of a bucket prefix (a lease object with a heartbeat);
- ``control.py``: the SigV4-signed requests obstore lacks, and :class:`MultipartUpload`;
- ``views.py``: flat byte views shared by the three data paths.
"""

from __future__ import annotations

from ...errors import BackendUnavailableError

try:  # the optional dependency: fail here, naming the extra, before any module below needs it
    import obstore  # noqa: F401
except ImportError as _exc:  # pragma: no cover - a child process covers it (test_conformance_s3.py)
    raise BackendUnavailableError("the s3:// tier needs obstore: pip install 'tiersave[s3]'") from _exc

from .control import MultipartUpload
from .errors import map_s3_error
from .options import S3Options
from .reader import S3BlobReader
from .store import S3Storage
from .writer import S3BlobWriter

__all__ = ["MultipartUpload", "S3BlobReader", "S3BlobWriter", "S3Options", "S3Storage", "map_s3_error"]
