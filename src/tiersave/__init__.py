"""tiersave: fast, stall-free, tiered checkpointing for PyTorch training.

The public API is re-exported here and locked by ``tests/unit/test_public_api.py``. Attributes are
loaded lazily (PEP 562) so that ``import tiersave`` and the CLI start without importing torch.
"""

import importlib as _importlib
import typing as _typing

from ._version import __version__
from .errors import (
    AlreadyExistsError,
    BackendUnavailableError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    DrainSupersededError,
    FormatError,
    NoSpaceError,
    ObjectNotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    SaveError,
    SaveTimeoutError,
    StateMismatchError,
    StorageError,
    TiersaveError,
    TiersaveWarning,
    TransientStorageError,
    UnsupportedFormatVersionError,
    UnsupportedStateError,
)

# name -> module that defines it; imported on first access.
_LAZY: dict[str, str] = {
    "Checkpointer": ".checkpointer",
    "RestoreReport": ".restore",
    "Tier": ".tiers",
    "watch": ".watch",
    "SaveHandle": ".handle",
    "SaveStats": ".handle",
    "CheckpointInfo": ".catalog",
    "VerifyReport": ".catalog",
    "RNGState": ".rng",
}

if _typing.TYPE_CHECKING:  # pragma: no cover
    # `import X as X` marks an explicit re-export, so type checkers see the lazily loaded names
    from .catalog import CheckpointInfo as CheckpointInfo
    from .catalog import VerifyReport as VerifyReport
    from .checkpointer import Checkpointer as Checkpointer
    from .handle import SaveHandle as SaveHandle
    from .handle import SaveStats as SaveStats
    from .restore import RestoreReport as RestoreReport
    from .rng import RNGState as RNGState
    from .tierspec import Tier as Tier
    from .watch import watch as watch

__all__ = [
    "AlreadyExistsError",
    "BackendUnavailableError",
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedCheckpointError",
    "DrainSupersededError",
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
    "__version__",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tiersave' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
