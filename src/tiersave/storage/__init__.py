"""Storage backends and the URI registry.

``open_storage(uri)`` maps a URI to a backend: a plain path or ``file:///path`` is a
:class:`~tiersave.storage.local.LocalStorage`. Backends import lazily so that optional dependencies are
needed only by the tiers that use them.
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


def open_storage(uri: str | os.PathLike[str] | Storage, *, create: bool = True) -> Storage:
    """Return the storage a URI names (a ``Storage`` instance is returned unchanged).

    Args:
        uri: a path, ``file:///path``, or a ``Storage``.
        create: create a missing local root directory (False: raise ``ObjectNotFoundError``).
    """
    if isinstance(uri, Storage):
        return uri
    text = os.fspath(uri)
    if not text:
        raise ConfigError("empty storage URI")
    parsed = urlparse(text)
    scheme = parsed.scheme.lower()
    from .local import LocalStorage

    if scheme in ("", "file"):
        path = unquote(parsed.path) if scheme == "file" else text
        if scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file URI with a remote host is not supported: {text!r}")
        return LocalStorage(path, create=create)
    raise ConfigError(f"unsupported storage URI scheme {scheme!r} in {text!r} (supported: a path, file://)")
