"""Per-chunk CRC-32C checksums (docs/format.md section 4)."""

from __future__ import annotations

from collections.abc import Iterator

import crc32c as _crc32c

ALGORITHM = "crc32c"


def crc32c_hex(data: memoryview | bytes | bytearray) -> str:
    """CRC-32C of ``data`` as 8 lowercase hex digits. Releases the GIL on large buffers."""
    return f"{_crc32c.crc32c(data):08x}"


def crc32c_update(crc: int, data: memoryview | bytes | bytearray) -> int:
    """Continue a CRC-32C over more bytes (for a chunk that arrives in pieces)."""
    return int(_crc32c.crc32c(data, crc))


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


def chunk_ranges(nbytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Yield ``(start, length)`` of each checksum chunk of an ``nbytes``-long tensor."""
    for start in range(0, nbytes, chunk_bytes):
        yield start, min(chunk_bytes, nbytes - start)
