"""The copy staging uses for large host tensors: non-temporal stores where the native routine was built.

Scope: loading ``_streamcopy.so`` (built from ``_streamcopy.c`` when the wheel is built, see hatch_build.py) with
ctypes, checking it, and choosing between it and ``memmove`` (``TIERSAVE_STAGE_COPY``). Anti-scope: how a copy is
cut into pieces and shared between threads (engine/stage.py).

Why a native routine: glibc's ``memmove`` copies the 1-240 MiB pieces of a staging copy with ordinary stores, each
of which first reads its destination line into the cache; streaming stores skip that read and leave the cache to
the training loop. Both routines release the GIL (ctypes foreign calls) and copy the same bytes; the streaming
one is only faster (one thread, 1 GiB in 8 MiB pieces on the development machine: 10.3 GB/s with ``memmove``,
20.4 with AVX2 streaming stores).
"""

from __future__ import annotations

import ctypes
import logging
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


def _load() -> tuple[CopyFn, str] | None:
    """The streaming copy and the name of its loop (``avx2`` or ``sse2``), or None where it was not built or
    cannot be used here (logged: the reason a job stages more slowly than it could)."""
    if not LIBRARY.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        abi = lib.tiersave_stream_copy_abi
        abi.restype = ctypes.c_int
        kind = lib.tiersave_stream_copy_kind
        kind.restype = ctypes.c_char_p
        copy = lib.tiersave_stream_copy
    except (OSError, AttributeError) as exc:
        log.warning("the streaming copy %s cannot be loaded (%s); staging copies with memmove", LIBRARY, exc)
        return None
    if abi() != _ABI:
        log.warning(
            "the streaming copy %s is from another version of tiersave (ABI %d, not %d); reinstall tiersave",
            LIBRARY,
            abi(),
            _ABI,
        )
        return None
    copy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    copy.restype = None
    return copy, kind().decode("ascii")


_STREAM = _load()


def stream_available() -> bool:
    """Whether the streaming copy was built and loads here."""
    return _STREAM is not None


def large_copy() -> tuple[CopyFn, str]:
    """The routine staging copies large host tensors with, and its name for reports, as ``TIERSAVE_STAGE_COPY``
    chooses (read now)."""
    choice = knobs.stage_copy()
    if choice == "memmove" or (choice == "auto" and _STREAM is None):
        return ctypes.memmove, "memmove"
    if _STREAM is None:
        raise ConfigError(
            f"TIERSAVE_STAGE_COPY=stream, but the streaming copy {LIBRARY.name} was not built for this install "
            "(it needs Linux on x86-64 and a C compiler when tiersave is installed; see hatch_build.py)"
        )
    copy, kind = _STREAM
    return copy, f"stream-{kind}"
