"""Page-aligned host buffers: what O_DIRECT needs, and what bounce buffers are made of.

Scope: ``aligned_buffer(n)``, a writable ``memoryview`` of ``n`` bytes whose address is a multiple of
4096, and the address and alignment checks of a buffer. Anti-scope: pinned (page-locked) buffers for
CUDA copies, which the engine's staging allocates with torch and checks the same way.

Backed by numpy (no torch), so the POSIX backend stays usable without torch.
"""

from __future__ import annotations

import numpy as np

from ...format.layout import ALIGN


def address_of(view: memoryview) -> int:
    """The address of a memoryview's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def is_aligned(view: memoryview, offset: int = 0, align: int = ALIGN) -> bool:
    """True when the buffer's address, its length and the file ``offset`` are all multiples of ``align``."""
    return offset % align == 0 and len(view) % align == 0 and address_of(view) % align == 0


def aligned_buffer(nbytes: int, align: int = ALIGN) -> memoryview:
    """A zero-filled, writable, ``align``-aligned buffer of ``nbytes`` bytes (a 1-D ``B`` memoryview)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes].data
