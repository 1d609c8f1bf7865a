"""What an :class:`~tiersave.storage.s3.S3Storage` connects to and how: :class:`S3Options` and its URI.

Scope: the option fields with their validation, parsing ``s3://BUCKET[/PREFIX]?OPTION=VALUE`` (the URI and
its options are documented in :mod:`tiersave.storage.s3`), filling what the URI leaves out from the
standard AWS environment variables, and S3's size limits that the options are checked against.
Anti-scope: opening connections (``store.py``), signing requests (``control.py``), any I/O.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ...errors import ConfigError
from ...units import parse_bytes, parse_duration
from ..base import check_key

MIN_PART_BYTES = 5 << 20
"""S3's smallest part (every part of a multipart upload but the last)."""
MAX_PARTS = 10_000
"""S3's largest part count: an object may hold at most ``MAX_PARTS * part_bytes`` bytes."""
MAX_SINGLE_PUT_BYTES = 5 << 30
"""S3's largest single PUT (a create-only put cannot be a multipart upload)."""

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True, kw_only=True)
class S3Options:
    """Where an :class:`~tiersave.storage.s3.S3Storage` lives and how it talks to it.

    The URI and its options are described in :mod:`tiersave.storage.s3`.

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
    origin: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)
    """Where ``endpoint`` and the credentials came from, and the names of the ``AWS_*`` variables that were
    set (``("aws_env", "AWS_REGION,AWS_PROFILE")``); names only, never values. Filled by :meth:`from_uri`,
    used by :meth:`access_summary` for error messages."""

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

    def access_summary(self) -> str:
        """Where this storage connects and with what, for an operator reading an access error.

        Names the endpoint, the bucket, the region, where the endpoint and credentials came from, and which
        ``AWS_*`` variables were set (names only: no key, secret or token ever appears).
        """
        origin = dict(self.origin)
        if self.endpoint:
            endpoint = f"endpoint {self.endpoint}" + (f" (from {origin['endpoint']})" if "endpoint" in origin else "")
        else:
            endpoint = (
                f"no endpoint set, so AWS's https://s3.{self.region}.amazonaws.com (for another service give the "
                "URI's endpoint= option or AWS_ENDPOINT_URL)"
            )
        if self.access_key_id is not None:
            where = origin.get("credentials", "options given in code")
            credentials = f"static credentials from {where}" + (" with a session token" if self.session_token else "")
        else:
            credentials = (
                "no credentials (no access_key_id/secret_access_key option, AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY not both set), so only instance or container credentials could apply"
            )
        if "aws_env" in origin:
            names = origin["aws_env"]
        else:
            names = ",".join(sorted(k for k, v in os.environ.items() if k.startswith("AWS_") and v))
        found = ", ".join(names.split(",")) if names else "none"
        return f"{endpoint}; bucket {self.bucket!r}, region {self.region}; {credentials}; AWS_* variables set: {found}"

    @property
    def http_allowed(self) -> bool:
        if self.allow_http is not None:
            return self.allow_http
        return bool(self.endpoint and self.endpoint.startswith("http://"))

    @classmethod
    def from_uri(cls, uri: str, *, env: Mapping[str, str] | None = None, **overrides: Any) -> S3Options:
        """Parse ``s3://bucket/prefix?option=value``; fill the rest from the AWS environment variables.

        Args:
            uri: the URI (options as in :mod:`tiersave.storage.s3`).
            env: the environment to read (default ``os.environ``).
            overrides: field values that win over both the URI and the environment.

        Raises:
            ConfigError: a malformed URI, an unknown option or a bad value.
        """
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
        origin = {"aws_env": ",".join(sorted(k for k, v in environ.items() if k.startswith("AWS_") and v))}
        if "endpoint" in values:
            origin["endpoint"] = "the URI's endpoint option"
        else:
            for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
                if environ.get(name):
                    values["endpoint"], origin["endpoint"] = environ[name], name
                    break
            else:
                values["endpoint"] = None
        values.setdefault("region", environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION") or "us-east-1")
        if "access_key_id" not in values and "secret_access_key" not in values:
            values["access_key_id"] = environ.get("AWS_ACCESS_KEY_ID") or None
            values["secret_access_key"] = environ.get("AWS_SECRET_ACCESS_KEY") or None
            values.setdefault("session_token", environ.get("AWS_SESSION_TOKEN") or None)
            origin["credentials"] = "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        else:
            origin["credentials"] = "the URI's access_key_id/secret_access_key options"
        for name, what in (("endpoint", "endpoint"), ("access_key_id", "credentials")):
            if name in overrides:
                origin[what] = "options given in code"
        if values.get("endpoint") is not None:
            values["endpoint"] = str(values["endpoint"]).rstrip("/")
        values.update(overrides)
        values.setdefault("origin", tuple(sorted(origin.items())))
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
