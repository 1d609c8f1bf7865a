"""The public API is exactly what tiersave.__all__ says (httpx's test_exported_members idea)."""

from __future__ import annotations

import subprocess
import sys

import tiersave


def test_all_lists_every_public_name_and_each_resolves():
    import types

    # submodules become package attributes once imported; they are not API names
    public = {
        n for n in dir(tiersave) if not n.startswith("_") and not isinstance(getattr(tiersave, n), types.ModuleType)
    }
    assert sorted(public - set(tiersave.__all__)) == []
    for name in tiersave.__all__:
        assert getattr(tiersave, name) is not None


def test_exported_names_are_stable():
    assert sorted(tiersave.__all__) == sorted(
        [
            "AlreadyExistsError",
            "BackendUnavailableError",
            "CheckpointInfo",
            "CheckpointNotFoundError",
            "Checkpointer",
            "ConfigError",
            "CorruptCheckpointError",
            "DistributedCheckpointError",
            "DrainSupersededError",
            "FormatError",
            "NoSpaceError",
            "ObjectNotFoundError",
            "PermissionDeniedError",
            "PreconditionFailedError",
            "RNGState",
            "RestoreReport",
            "SaveError",
            "SaveHandle",
            "SaveStats",
            "SaveTimeoutError",
            "StateMismatchError",
            "StorageError",
            "Tier",
            "TiersaveError",
            "TiersaveWarning",
            "TransientStorageError",
            "UnsupportedFormatVersionError",
            "UnsupportedStateError",
            "VerifyReport",
            "__version__",
            "watch",
        ]
    )


def test_every_error_derives_from_the_root():
    for name in tiersave.__all__:
        obj = getattr(tiersave, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, (tiersave.TiersaveError, tiersave.TiersaveWarning)), name
            assert issubclass(obj, Exception)  # never BaseException: `except Exception` catches it


def test_import_does_not_import_torch():
    code = "import sys, tiersave, tiersave.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
