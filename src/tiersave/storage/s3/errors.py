"""The one place where this backend's native errors become tiersave's error tree.

Scope: :func:`map_s3_error` (an obstore exception, an ``OSError`` or an HTTP status of our own signed
request -> a :class:`~tiersave.errors.StorageError` subclass whose message names the tier, the key, the
action and the S3 error code), :func:`mapped_errors` (the same as a ``with`` block), and
:func:`error_summary` (one short line of a native message). Anti-scope: retrying (obstore retries its
requests, ``control.py`` its own), deciding what to do about an error.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from obstore import exceptions as _obx

from ...errors import (
    AlreadyExistsError,
    ObjectNotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StorageError,
    TiersaveError,
    TransientStorageError,
)
from .options import S3Options

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


def error_summary(text: str) -> str:
    """The first line of a native error message, without the XML body obstore appends, cut to 300 chars."""
    first = text.strip().split("\n", 1)[0]
    first = re.sub(r"<\?xml.*", "", first).strip().rstrip(":")
    return first[:300]


def _is_transient(exc: BaseException, status: int | None, lowered: str) -> bool:
    if status is not None:  # 501 Not Implemented: the store lacks the feature, asking again will not help
        return (status >= 500 and status != 501) or status in (408, 429)
    return isinstance(exc, (ConnectionError, TimeoutError)) or any(w in lowered for w in _NETWORK_WORDS)


def map_s3_error(
    exc: BaseException,
    *,
    tier: str,
    key: str,
    action: str,
    status: int | None = None,
    body: str = "",
    options: S3Options | None = None,
) -> StorageError:
    """Map an obstore exception, or an HTTP status of our own request, to a :class:`StorageError`.

    This is the one place where this backend's native errors become tiersave's; messages name the tier,
    the key, the action and the S3 error code.

    Args:
        exc: the native error (an ``obstore.exceptions`` error, ``OSError``...).
        tier: the storage URI.
        key: the key relative to the storage root.
        action: what was being done (``"writing"``), for the message.
        status: the HTTP status when known (our own signed requests, ``control.py``).
        body: the response body when known.
        options: the storage's options: an error an operator must fix (access refused, no such bucket, no
            connection) then says where it connected and with what (:meth:`S3Options.access_summary`).
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
        part for part in (f"HTTP {status}" if status else "", code, "" if status else error_summary(str(exc))) if part
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
    # Errors an operator fixes in the setup (refused access, a missing bucket, no connection at all) say
    # where the request went and with what; a missing key or a lost race is the normal flow and does not.
    setup_problem = (
        cls is PermissionDeniedError
        or code == "NoSuchBucket"
        or (status is None and cls in (StorageError, TransientStorageError))
    )
    if options is not None and setup_problem:
        message += f" [{options.access_summary()}]"
    return cls(message, tier=tier, key=key)


@contextlib.contextmanager
def mapped_errors(tier: str, action: str, key: str, options: S3Options | None = None) -> Iterator[None]:
    """Re-raise any non-tiersave exception of the block as :func:`map_s3_error` maps it.

    Args:
        tier: the storage URI.
        action: what the block does (``"reading"``), for the message.
        key: the key relative to the storage root.
        options: the storage's options, for errors an operator must fix (see :func:`map_s3_error`).
    """
    try:
        yield
    except TiersaveError:
        raise
    except Exception as exc:
        raise map_s3_error(exc, tier=tier, key=key, action=action, options=options) from exc
