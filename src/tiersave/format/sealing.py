"""The manifest's own checksum (docs/format.md 4.3): sealing a document, and checking a parsed one.

Scope: ``checksum.manifest_sha256``: the SHA-256 of the manifest's canonical bytes without that field, written
by :func:`seal` and checked by :func:`check_seal` before any value of a parsed manifest is used, with the
shortcut of hashing the bytes as read (:func:`raw_seal_matches`) when they are a conforming writer's.
Anti-scope: what the fields mean (``manifest.py``), reading and writing files.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from ..errors import CorruptCheckpointError, FormatError
from .jsonsafe import dumps_canonical

MANIFEST_HASH_FIELD = "manifest_sha256"
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
VERSION_RE = re.compile(r"^([0-9]{1,4})\.([0-9]{1,4})$")


def raw_seal_matches(data: bytes, field: str, expected: str) -> bool:
    """True when ``data`` with ``,"<field>":"<expected>"`` cut out hashes (SHA-256) to ``expected``.

    The spec's check (docs/format.md 4.3) re-serializes the parsed document without the field and hashes
    that; a conforming writer's manifest *is* those canonical bytes with the field added as the last key of
    ``checksum``, so hashing the bytes as read, minus the field, gives the same digest without serializing
    10^5 entries again. A match means the bytes are the very bytes that were hashed (a match otherwise would
    need a SHA-256 preimage); anything else (damage, another writer's whitespace or escaping, the field
    elsewhere) returns False and the caller runs the spec's check, which decides and names the fault.
    """
    needle = f',"{field}":"{expected}"'.encode()
    at = data.find(needle)
    if at < 0:
        return False
    view = memoryview(data)
    digest = hashlib.sha256(view[:at])
    digest.update(view[at + len(needle) :])
    return digest.hexdigest() == expected


def seal_bytes(doc: dict[str, Any], field: str) -> bytes:
    """``doc`` serialized with ``doc["checksum"][field]`` set (as its last key) to the SHA-256 of the canonical
    bytes of ``doc`` without it (docs/format.md 4.3).

    Serializes once, not twice: the sealed bytes are the unsealed ones with the field spliced in before the
    brace that closes ``checksum``, whose position is the length of the document serialized up to and
    including ``checksum`` (a few hundred bytes), checked to be a prefix before it is trusted.
    """
    checksum = doc["checksum"]
    checksum.pop(field, None)
    unsealed = dumps_canonical(doc)
    keys = list(doc)
    head = dumps_canonical({k: doc[k] for k in keys[: keys.index("checksum") + 1]})
    digest = hashlib.sha256(unsealed).hexdigest()
    checksum[field] = digest
    if len(checksum) == 1 or not unsealed.startswith(head[:-1]):
        return dumps_canonical(doc)  # nothing to splice after (the field alone): serialize again
    at = len(head) - 2
    return b"".join((unsealed[:at], f',"{field}":"{digest}"'.encode(), unsealed[at:]))


def seal(doc: dict[str, Any]) -> bytes:
    """Serialize a manifest document with its integrity field: ``doc["checksum"]["manifest_sha256"]`` is set
    (replaced if present) to the SHA-256 of the canonical bytes of ``doc`` without it. Returns the bytes."""
    return seal_bytes(doc, MANIFEST_HASH_FIELD)


def check_seal(doc: Any, path: str, data: bytes | None = None) -> bool:
    """Check and remove the manifest's own checksum. Returns False for a format 1.0 manifest without one.

    Raises:
        CorruptCheckpointError: the manifest's bytes do not match its checksum.
        FormatError: a 1.1+ manifest lacks its checksum, or the field is malformed.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("checksum"), dict):
        return False  # not a manifest at all: the structural checks say what is wrong
    checksum = doc["checksum"]
    expected = checksum.pop(MANIFEST_HASH_FIELD, None)
    if expected is None:
        version = doc.get("format_version")
        m = VERSION_RE.match(version) if isinstance(version, str) else None
        if m is not None and (int(m.group(1)), int(m.group(2))) >= (1, 1):
            raise FormatError(f"{path}: format {version} manifest lacks checksum.{MANIFEST_HASH_FIELD}", path=path)
        return False
    if not isinstance(expected, str) or not SHA256_HEX.match(expected):
        raise FormatError(f"{path}: checksum.{MANIFEST_HASH_FIELD} must be 64 lowercase hex digits", path=path)
    if data is not None and raw_seal_matches(data, MANIFEST_HASH_FIELD, expected):
        return True  # the bytes as read are the bytes that were hashed: no need to serialize them again
    actual = hashlib.sha256(dumps_canonical(doc)).hexdigest()
    if actual != expected:
        raise CorruptCheckpointError(
            f"{path}: the manifest does not match its checksum (sha256 {actual[:16]}..., recorded "
            f"{expected[:16]}...): it was damaged or edited after it was written",
            path=path,
            file="manifest.json",
        )
    return True
