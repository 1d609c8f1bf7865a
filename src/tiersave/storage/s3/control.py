"""The few S3 requests obstore 0.12 cannot make, signed here with AWS Signature Version 4.

Scope: :class:`S3Control` (list and abort unfinished multipart uploads, create a bucket) over
``http.client``, one connection per request, with its own bounded retries; :class:`MultipartUpload`, what
the listing returns; parsing the XML answers (bounded in size). Static credentials only.
Anti-scope: object data (obstore moves every byte, ``reader.py``/``writer.py``/``store.py``), deciding
which uploads to abort (``S3Storage.abort_multipart_uploads``), mapping errors (``errors.py``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import http.client
import ssl
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass

from ...errors import ConfigError, StorageError
from .errors import map_s3_error
from .options import S3Options

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_MAX_RESPONSE_BYTES = 16 << 20


@dataclass(frozen=True)
class MultipartUpload:
    """An unfinished multipart upload, as listed by :meth:`~tiersave.storage.s3.S3Storage.list_multipart_uploads`.

    Attributes:
        key: the object key relative to the storage root.
        upload_id: the service's id of the upload.
        initiated: when the upload started (seconds since the epoch).
    """

    key: str
    upload_id: str
    initiated: float


class S3Control:
    """The few S3 requests obstore 0.12 lacks (list/abort multipart uploads, create bucket), signed with
    AWS Signature Version 4 over ``http.client``. Static credentials only; one connection per request.

    Args:
        options: the storage's options (endpoint, region, credentials, timeouts, retries).

    Raises:
        ConfigError: no static credentials, or an ``http://`` endpoint while ``allow_http`` is false.

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
        """Send one signed request with an empty body; retry 5xx, 408, 429 and connection errors.

        Args:
            method: the HTTP method.
            key: the full key (prefix included), or "" for the bucket.
            query: query parameters (signed).
            action: what the request does, for error messages.
            ok: the statuses that count as success.
            retries: retries after the first attempt (default: the options' ``max_retries``).

        Returns:
            The status and up to 16 MiB + 1 bytes of the body.

        Raises:
            StorageError: as :func:`~tiersave.storage.s3.errors.map_s3_error` maps the last failure.
        """
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
            options=self.options,
        )

    def list_uploads(self, prefix: str) -> list[MultipartUpload]:
        """Unfinished uploads of ``prefix`` itself or of keys under ``prefix/`` (relative keys), sorted."""
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
            following = {"key-marker": next_key, "upload-id-marker": root.findtext(f"{_NS}NextUploadIdMarker") or ""}
            if not next_key or following == marker:  # no way on, or a server repeating its page: stop, not loop
                break
            marker = following
        return sorted(out.values(), key=lambda u: (u.key, u.upload_id))

    def abort_upload(self, key: str, upload_id: str, *, retries: int | None = None) -> None:
        """Abort one upload (relative key); an upload already gone (404) counts as aborted."""
        self.request(
            "DELETE",
            self._full_key(key),
            {"uploadId": upload_id},
            action="aborting upload of",
            ok=(200, 204, 404),
            retries=retries,
        )

    def create_bucket(self) -> None:
        """Create the bucket; one this account already owns is fine, one owned by another is an error."""
        status, body = self.request("PUT", "", {}, action="creating bucket", ok=(200, 409))
        if status == 409 and b"BucketAlreadyOwnedByYou" not in body:
            text = body[:4096].decode("utf-8", "replace")
            raise map_s3_error(
                StorageError("conflict"),
                tier=self.options.uri,
                key="",
                action="creating bucket",
                status=409,
                body=text,
                options=self.options,
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
