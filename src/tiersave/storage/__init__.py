"""Storage backends and the URI registry.

``open_storage(uri)`` maps a URI to a backend:

- a plain path or ``file:///path``: :class:`~tiersave.storage.posix.LocalStorage`;
- ``mem://NAME``: :class:`~tiersave.storage.memory.MemoryStorage`, shared memory on this node;
- ``s3://BUCKET/PREFIX?endpoint=...``: :class:`~tiersave.storage.s3.S3Storage` (needs ``tiersave[s3]``;
  options in :mod:`tiersave.storage.s3`).

Backends import lazily so that optional dependencies are needed only by the tiers that use them.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from ..errors import ConfigError
from .base import BlobReader, BlobWriter, ObjectInfo, PutMode, Storage, StorageCapabilities

__all__ = [
    "BlobReader",
    "BlobWriter",
    "ObjectInfo",
    "PutMode",
    "Storage",
    "StorageCapabilities",
    "open_storage",
]


def open_storage(uri: str | os.PathLike[str] | Storage, *, create: bool = True, io: str | None = None) -> Storage:
    """Return the storage a URI names (a ``Storage`` instance is returned unchanged).

    Args:
        uri: a path, ``file:///path``, ``mem://NAME``, ``s3://bucket/prefix?options``, or a ``Storage``.
        create: create a missing local root or memory namespace (False: raise ``ObjectNotFoundError``).
            An S3 bucket is never created here.
        io: for a local path: ``"auto"``, ``"direct"`` or ``"buffered"`` (None: ``TIERSAVE_IO``, else auto).

    Raises:
        ConfigError: an unknown scheme or a malformed URI.
        BackendUnavailableError: the backend's optional dependency is missing (the message says what to
            install).
    """
    if isinstance(uri, Storage):
        return uri
    text = os.fspath(uri)
    if not text:
        raise ConfigError("empty storage URI")
    parsed = urlparse(text)
    scheme = parsed.scheme.lower()
    from .posix import LocalStorage

    if scheme in ("", "file"):
        path = unquote(parsed.path) if scheme == "file" else text
        if scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file URI with a remote host is not supported: {text!r}")
        return LocalStorage(path, create=create, io=io)
    if scheme == "mem":
        from .memory import MemoryStorage

        name = (parsed.netloc + unquote(parsed.path)).strip("/")
        if parsed.query or parsed.fragment:
            raise ConfigError(f"mem:// URIs take no options: {text!r}")
        return MemoryStorage(name, create=create)
    if scheme == "s3":
        from .s3 import S3Storage  # raises BackendUnavailableError naming tiersave[s3] without obstore

        return S3Storage.from_uri(text)
    raise ConfigError(
        f"unsupported storage URI scheme {scheme!r} in {text.split('?', 1)[0]!r} "
        "(supported: a path, file://, mem://, s3://)"
    )
