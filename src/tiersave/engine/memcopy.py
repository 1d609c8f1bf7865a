"""The copy staging uses for large host copies: non-temporal stores where the native routine was built.

Scope: loading ``_streamcopy.so`` (built from ``_streamcopy.c`` when the wheel or the editable install is built,
see hatch_build.py) with ctypes, checking it, and choosing between it and ``memmove`` (``TIERSAVE_STAGE_COPY``).
Anti-scope: how a copy is cut into pieces and shared between threads, and which copies stream (engine/stage.py).

Why a native routine: glibc's ``memmove`` copies the 8 MiB pieces of a staging copy with ordinary stores, each
of which first reads its destination line into the cache; streaming stores skip that read. Both routines release
the GIL (ctypes foreign calls) and copy the same bytes; the streaming one is only faster for copies much larger
than the cache (recorded in benchmarks/results/stream-20261125/memmove_pieces.txt: the bench's 3 GB state on
two threads in 132 ms against 193 ms with ``memmove``).

The library is loaded on first use, not at import: a process that never stages (or chooses ``memmove``) never
opens it. It is refused, with a warning naming the reason, when it cannot be loaded, when it is from another
ABI, or when it was built from another ``_streamcopy.c`` than the one beside it (a stale build left in an
editable install): staging then copies with ``memmove``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import knobs
from ..errors import ConfigError

log = logging.getLogger(__name__)

LIBRARY = Path(__file__).with_name("_streamcopy.so")
_ABI = 1

CopyFn = Callable[[int, int, int], Any]
"""``copy(dst, src, nbytes)`` between non-overlapping host addresses."""


def _load(library: Path) -> tuple[CopyFn, str] | None:
    """The streaming copy in ``library`` and the name of its loop (``avx2`` or ``sse2``), or None where it was
    not built or cannot be used here (logged: the reason a job stages more slowly than it could)."""
    if not library.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(library))
        abi_fn, kind_fn, source_fn = (
            lib.tiersave_stream_copy_abi,
            lib.tiersave_stream_copy_kind,
            lib.tiersave_stream_copy_source,
        )
        copy = lib.tiersave_stream_copy
    except (OSError, AttributeError) as exc:
        log.warning("the streaming copy %s cannot be loaded (%s); staging copies with memmove", library, exc)
        return None
    abi_fn.restype = ctypes.c_int
    kind_fn.restype = source_fn.restype = ctypes.c_char_p
    abi, kind, built_from = abi_fn(), kind_fn(), source_fn()
    if abi != _ABI:
        log.warning(
            "the streaming copy %s is from another version of tiersave (ABI %d, not %d); reinstall tiersave",
            library,
            abi,
            _ABI,
        )
        return None
    source = library.with_suffix(".c")
    if (
        source.is_file()
        and (built_from or b"").decode("ascii", "replace") != hashlib.sha256(source.read_bytes()).hexdigest()
    ):
        log.warning(
            "the streaming copy %s was built from another %s (a stale build); reinstall tiersave to rebuild "
            "it; staging copies with memmove",
            library,
            source.name,
        )
        return None
    copy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    copy.restype = None
    return copy, (kind or b"unknown").decode("ascii", "replace")


_lock = threading.Lock()
_loaded: list[tuple[CopyFn, str] | None] = []  # empty until the first use, then the one answer of _load


def _stream() -> tuple[CopyFn, str] | None:
    with _lock:
        if not _loaded:
            _loaded.append(_load(LIBRARY))
        return _loaded[0]


def stream_available() -> bool:
    """Whether the streaming copy was built and loads here."""
    return _stream() is not None


def large_copy() -> tuple[CopyFn, str]:
    """The routine staging copies large host memory with, and its name for reports, as ``TIERSAVE_STAGE_COPY``
    chooses (read now)."""
    choice = knobs.stage_copy()
    if choice == "memmove":
        return ctypes.memmove, "memmove"
    stream = _stream()
    if stream is None:
        if choice == "auto":
            return ctypes.memmove, "memmove"
        raise ConfigError(
            f"TIERSAVE_STAGE_COPY=stream, but the streaming copy {LIBRARY.name} was not built for this install "
            "(it needs Linux on x86-64 and a C compiler when tiersave is installed; see hatch_build.py)"
        )
    copy, kind = stream
    return copy, f"stream-{kind}"
