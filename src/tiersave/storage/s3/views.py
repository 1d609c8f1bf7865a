"""Flat byte views over the callers' buffers, shared by whole-object puts, the reader and the writer.

Scope: :func:`byte_view`. Anti-scope: copying (a view never copies), allocating buffers (``writer.py``
recycles its own part buffers).
"""

from __future__ import annotations


def byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    """``data`` as a one-dimensional view of unsigned bytes (a tensor's buffer may be typed or shaped)."""
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
