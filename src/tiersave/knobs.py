"""Tunables read from ``TIERSAVE_*`` environment variables, with overrides for tests.

Convention (as torchsnapshot's knobs.py): each knob is a function returning the current value (the
environment variable if set and valid, else the default) and an ``override_*`` context manager. Values
are read at call time, so a knob set after import still applies. Invalid values raise ``ConfigError``
naming the variable rather than being ignored.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .errors import ConfigError

_IO_THREADS = "TIERSAVE_IO_THREADS"
_CHUNK_BYTES = "TIERSAVE_CHUNK_BYTES"
_LEFTOVER_GRACE_S = "TIERSAVE_LEFTOVER_GRACE_S"
_CONTENT_HASH = "TIERSAVE_CONTENT_HASH"
_REUSE_LAYOUT = "TIERSAVE_REUSE_LAYOUT"
_STAGE_COPY = "TIERSAVE_STAGE_COPY"
CONTENT_HASH_CHOICES = ("auto", "blake3", "sha256")
STAGE_COPY_CHOICES = ("auto", "stream", "memmove")


def int_env(name: str, default: int, lo: int, hi: int) -> int:
    """The integer in environment variable ``name`` (``default`` when unset), checked to be in [lo, hi]."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range [{lo}, {hi}]")
    return value


def io_threads() -> int:
    """Threads that read and write shard chunks in parallel (``TIERSAVE_IO_THREADS``)."""
    return int_env(_IO_THREADS, min(8, max(2, 2 * (os.cpu_count() or 1))), 1, 256)


def chunk_bytes() -> int:
    """Checksum and I/O chunk size in bytes (``TIERSAVE_CHUNK_BYTES``), a multiple of 4096, <= 64 MiB."""
    value = int_env(_CHUNK_BYTES, 64 << 20, 4096, 64 << 20)
    if value % 4096:
        raise ConfigError(f"{_CHUNK_BYTES}={value} is not a multiple of 4096")
    return value


def leftover_grace_s() -> int:
    """Seconds after its newest object or upload an attempt of another host (whose writer this host cannot ask
    about: an object store's, or a shared file system's temporary directory) counts as abandoned and is removed
    by the retention after a commit (default one day: far longer than any save takes, short enough that space
    comes back)."""
    return int_env(_LEFTOVER_GRACE_S, 86_400, 1, 10 * 365 * 86_400)


def reuse_layout() -> bool:
    """Whether a save of a state with the previous save's structure reuses its layout (``TIERSAVE_REUSE_LAYOUT``,
    1 by default; 0 lays every save out afresh, as a way to rule the reuse out when chasing a problem)."""
    return bool(int_env(_REUSE_LAYOUT, 1, 0, 1))


def content_hash() -> str:
    """The hash of an incremental save's pieces (``TIERSAVE_CONTENT_HASH``): ``auto`` (BLAKE3 where the
    ``blake3`` package is installed, else SHA-256), ``blake3`` or ``sha256``."""
    raw = os.environ.get(_CONTENT_HASH) or "auto"
    if raw not in CONTENT_HASH_CHOICES:
        raise ConfigError(f"{_CONTENT_HASH}={raw!r} is not one of {', '.join(CONTENT_HASH_CHOICES)}")
    return raw


def stage_copy() -> str:
    """How staging copies large host tensors (``TIERSAVE_STAGE_COPY``): ``auto`` (the streaming copy where it was
    built, else ``memmove``), ``stream`` (the streaming copy; an error where it was not built) or ``memmove``."""
    raw = os.environ.get(_STAGE_COPY) or "auto"
    if raw not in STAGE_COPY_CHOICES:
        raise ConfigError(f"{_STAGE_COPY}={raw!r} is not one of {', '.join(STAGE_COPY_CHOICES)}")
    return raw


@contextlib.contextmanager
def override_env(name: str, value: object) -> Iterator[None]:
    """Set environment variable ``name`` for the duration of a ``with`` block (tests)."""
    old = os.environ.get(name)
    os.environ[name] = str(value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def override_io_threads(value: int) -> contextlib.AbstractContextManager[None]:
    return override_env(_IO_THREADS, value)


def override_chunk_bytes(value: int) -> contextlib.AbstractContextManager[None]:
    return override_env(_CHUNK_BYTES, value)


def override_content_hash(value: str) -> contextlib.AbstractContextManager[None]:
    return override_env(_CONTENT_HASH, value)
