"""The tiersave exception tree.

Every error tiersave raises derives from :class:`TiersaveError`, so ``except TiersaveError`` catches all
of them; the builtin mix-ins let code that already catches ``FileNotFoundError`` or ``ValueError`` keep
working::

    TiersaveError(Exception)
    ├── ConfigError(ValueError)                bad options or arguments, detected before any I/O
    ├── UnsupportedStateError(TypeError)       an object in the state tree that cannot be saved; .path
    ├── StateMismatchError(ValueError)         restore into a state whose tensors do not fit the checkpoint
    ├── BackendUnavailableError(ImportError)   an optional dependency is missing; the message says what to install
    ├── StorageError                           I/O failed; .tier, .key
    │   ├── ObjectNotFoundError(FileNotFoundError)
    │   ├── AlreadyExistsError(FileExistsError)   a create-only write found the key taken (never overwritten), or a
    │   │                                         directory to remove was not empty (a file landed meanwhile)
    │   ├── PreconditionFailedError               a conditional write lost a race
    │   ├── PermissionDeniedError(PermissionError)
    │   ├── NoSpaceError                          ENOSPC / EDQUOT: the save is lost, earlier ones are intact
    │   └── TransientStorageError                 retryable (throttling, 5xx, EAGAIN)
    ├── FormatError                            a checkpoint that is not valid tiersave v1; .path
    │   ├── CorruptCheckpointError                checksum, size or structure mismatch; .step, .file, .tensor
    │   └── UnsupportedFormatVersionError         written by an incompatible (newer major) format version
    ├── CheckpointNotFoundError(LookupError)   no committed checkpoint matches the request
    ├── DrainSupersededError                   a save deferred behind a busy tier was replaced by a newer one there
    ├── SaveError                              a save did not complete; nothing of it became visible
    │   ├── SaveTimeoutError(TimeoutError)
    │   └── WriterLockedError                 another live writer holds the root's writer lock; .uri, .holder
    └── DistributedCheckpointError             per-rank failures in .failures

Warnings use :class:`TiersaveWarning`.
"""

from __future__ import annotations

import errno

__all__ = [
    "AlreadyExistsError",
    "BackendUnavailableError",
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "FormatError",
    "NoSpaceError",
    "ObjectNotFoundError",
    "PermissionDeniedError",
    "PreconditionFailedError",
    "SaveError",
    "SaveTimeoutError",
    "StateMismatchError",
    "StorageError",
    "TiersaveError",
    "TiersaveWarning",
    "TransientStorageError",
    "UnsupportedFormatVersionError",
    "UnsupportedStateError",
    "WriterLockedError",
    "storage_error_from_os",
]


class TiersaveError(Exception):
    """Root of every error raised by tiersave."""


class TiersaveWarning(UserWarning):
    """Category of the warnings tiersave emits (skipped saves, fallbacks, slow tiers)."""


class ConfigError(TiersaveError, ValueError):
    """An option or argument is invalid; raised before any I/O happens."""


class ClosedError(ConfigError, RuntimeError):
    """An object was used after it was closed or shut down (a Checkpointer, a thread pool).

    A ``RuntimeError`` too, as ``concurrent.futures`` executors raise on a submit after shutdown."""


class UnsupportedStateError(TiersaveError, TypeError):
    """The state tree holds an object that tiersave cannot save without pickle.

    Attributes:
        path: where the object sits in the state tree, e.g. ``"optim.state.0.step"``.
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class StateMismatchError(TiersaveError, ValueError):
    """Restoring into an existing state failed because a tensor does not fit (shape, dtype, missing key)."""


class BackendUnavailableError(TiersaveError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class StorageError(TiersaveError):
    """An I/O operation on a tier failed.

    Attributes:
        tier: the tier's URI or name.
        key: the path or object key involved, relative to the tier root.
    """

    def __init__(self, message: str, *, tier: str = "", key: str = "") -> None:
        super().__init__(message)
        self.tier = tier
        self.key = key


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The path or object key does not exist."""


class AlreadyExistsError(StorageError, FileExistsError):
    """A create-only write found the target already present; nothing was overwritten."""


class PreconditionFailedError(StorageError):
    """A conditional write lost a race with another writer."""


class PermissionDeniedError(StorageError, PermissionError):
    """The tier refused access."""


class NoSpaceError(StorageError):
    """The tier ran out of space or quota (ENOSPC, EDQUOT). The save in progress is lost; earlier ones are not."""


class TransientStorageError(StorageError):
    """A retryable failure (throttling, server error, interrupted call)."""


class FormatError(TiersaveError):
    """A file is not a valid tiersave checkpoint.

    Attributes:
        path: the checkpoint or file concerned.
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class CorruptCheckpointError(FormatError):
    """Stored bytes do not match the manifest (checksum, size, truncation, foreign shard).

    Attributes:
        step: the checkpoint's step, when known.
        file: the shard file or object key.
        tensor: the tensor whose bytes failed, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str = "",
        step: int | None = None,
        file: str = "",
        tensor: str = "",
    ) -> None:
        super().__init__(message, path=path)
        self.step = step
        self.file = file
        self.tensor = tensor


class UnsupportedFormatVersionError(FormatError):
    """The checkpoint was written with a format major version this tiersave cannot read."""


class CheckpointNotFoundError(TiersaveError, LookupError):
    """No committed checkpoint matches the request (step, tag, or any at all)."""


class SaveError(TiersaveError):
    """A save did not complete. Nothing of it became visible; earlier checkpoints are intact."""


class DrainSupersededError(TiersaveError):
    """A save waiting to be copied to a busy later tier was not copied there: a newer save took its place (the
    tier catches up on the newest due save only). ``handle.tier_result(tier)`` raises it; the checkpoint itself
    is intact on the tiers it reached."""


class SaveTimeoutError(SaveError, TimeoutError):
    """Waiting for a save exceeded the given timeout (the save itself may still complete)."""


class WriterLockedError(SaveError):
    """Another live writer holds this root's writer lock (docs/guarantees.md, "One writer per root").

    Attributes:
        uri: the root.
        holder: ``{"host", "pid", "since"}`` of the writer holding it, or None when the lock names nobody.
    """

    def __init__(self, message: str, *, uri: str = "", holder: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.uri = uri
        self.holder = holder


class DistributedCheckpointError(TiersaveError):
    """One or more ranks failed; ``failures`` maps rank to its exception."""

    def __init__(self, message: str, failures: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, BaseException] = dict(failures or {})

    def __str__(self) -> str:
        base = super().__str__()
        if not self.failures:
            return base
        lines = [base] + [f"  rank {r}: {type(e).__name__}: {e}" for r, e in sorted(self.failures.items())]
        return "\n".join(lines)


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_TRANSIENT = {errno.EINTR, errno.EAGAIN, errno.ETIMEDOUT, errno.EBUSY}
_PERMISSION = {errno.EACCES, errno.EPERM, errno.EROFS}


def storage_error_from_os(exc: OSError, *, tier: str, key: str, action: str) -> StorageError:
    """Map an ``OSError`` to the matching :class:`StorageError` subclass (the one place for POSIX errors).

    Args:
        exc: the native error.
        tier: the tier URI, for the message.
        key: the path relative to the tier root.
        action: what was being done, e.g. ``"writing"``; used in the message.
    """
    code = exc.errno
    detail = exc.strerror or str(exc)
    message = f"{action} {key!r} on {tier} failed: {detail}"
    cls: type[StorageError]
    if isinstance(exc, FileNotFoundError) or code == errno.ENOENT:
        cls = ObjectNotFoundError
    elif isinstance(exc, FileExistsError) or code in (errno.EEXIST, errno.ENOTEMPTY):
        cls = AlreadyExistsError
    elif code in _NO_SPACE:
        cls = NoSpaceError
        message += " (out of space or quota: this save is lost, earlier checkpoints are intact)"
    elif code in _PERMISSION:
        cls = PermissionDeniedError
    elif code in _TRANSIENT:
        cls = TransientStorageError
    else:
        cls = StorageError
    return cls(message, tier=tier, key=key)
