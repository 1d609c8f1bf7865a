"""Per-chunk CRC-32C checksums (docs/format.md section 4): taking them, alone or in the same pass as a copy,
and combining the checksums of consecutive pieces."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import crc32c as _crc32c

ALGORITHM = "crc32c"


def crc32c_hex(data: memoryview | bytes | bytearray) -> str:
    """CRC-32C of ``data`` as 8 lowercase hex digits. Releases the GIL on large buffers."""
    return f"{_crc32c.crc32c(data):08x}"


def crc32c_update(crc: int, data: memoryview | bytes | bytearray) -> int:
    """Continue a CRC-32C over more bytes (for a chunk that arrives in pieces)."""
    return int(_crc32c.crc32c(data, crc))


FUSE_BYTES = 256 << 10
"""A piece copied then checksummed: small enough to stay in a core's L2 cache between the two."""


def copy_checksum(crc: int, dst: memoryview, dst_addr: int, src_addr: int) -> int:
    """Copy ``len(dst)`` bytes from address ``src_addr`` into ``dst`` (a ``B`` view at address ``dst_addr``)
    and return ``crc`` continued over them: each piece of ``FUSE_BYTES`` is checksummed right after its copy,
    while it is still in cache, so the checksum does not read the bytes back from memory (both calls release
    the GIL). For a save's staging copy and a restore's copy out of a bounce buffer; measured here: copy then
    CRC 190-220 ms per GiB, fused 125-165 ms (docs/benchmarks.md)."""
    memmove, n = ctypes.memmove, len(dst)
    for off in range(0, n, FUSE_BYTES):
        k = min(FUSE_BYTES, n - off)
        memmove(dst_addr + off, src_addr + off, k)
        crc = crc32c_update(crc, dst[off : off + k])
    return crc


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


def chunk_ranges(nbytes: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Yield ``(start, length)`` of each checksum chunk of an ``nbytes``-long tensor."""
    for start in range(0, nbytes, chunk_bytes):
        yield start, min(chunk_bytes, nbytes - start)


# CRC-32C combination (Mark Adler's method, as zlib's crc32_combine): the CRC of A followed by B from the CRCs
# of A and B and the length of B, by multiplying A's CRC by x^(8 * len(B)) modulo the (reflected) polynomial.
# It lets several threads checksum consecutive pieces of one chunk and the chunk still get one CRC-32C.
_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the polynomial, both reflected."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    """``x^(2^k)`` modulo the polynomial for k in 0..30: for CRC-32C, x^(2^31) is x again (the table repeats
    every 31 entries, not every 32 as zlib's table for CRC-32 does), so entry k is ``table[k % 31]``."""
    p, table = 1 << 30, []  # x^1
    for _ in range(31):
        table.append(p)
        p = _multmodp(p, p)
    return tuple(table)


_X2N = _x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32C of ``A + B`` from ``crc1`` (of A), ``crc2`` (of B) and ``len2 == len(B)`` in bytes."""
    if len2 < 0:
        raise ValueError(f"crc32c_combine: negative length {len2}")
    p, n, k = 1 << 31, len2, 3  # x^0; the factor is x^(8 * len2) = x^(len2 * 2^3)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k % 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2
