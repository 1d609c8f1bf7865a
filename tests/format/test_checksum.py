"""CRC-32C combination: the checksum of consecutive pieces, taken on different threads, joined into the
checksum of the whole chunk (what a staging copy split over threads records)."""

from __future__ import annotations

from itertools import pairwise

import crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiersave.format.checksum import crc32c_combine


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600), st.binary(max_size=600))
def test_combined_crc_of_two_pieces_equals_the_crc_of_both(a: bytes, b: bytes) -> None:
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_combination_folds_over_many_pieces_of_a_large_chunk() -> None:
    data = bytes(range(256)) * 4099 + b"tail"  # pieces of uneven sizes, one longer than 2^20 bytes
    cuts = [0, 1, 4096, 70_001, 1_048_577, len(data)]
    crc = 0
    for start, end in pairwise(cuts):
        crc = crc32c_combine(crc, crc32c.crc32c(data[start:end]), end - start)
    assert crc == crc32c.crc32c(data)


def test_a_negative_length_is_refused() -> None:
    with pytest.raises(ValueError, match="negative length"):
        crc32c_combine(0, 0, -1)


def test_combination_holds_past_the_table_period_for_long_second_pieces() -> None:
    """For CRC-32C, x^(2^31) is x again: the table of x^(2^k) repeats every 31 entries. Indexing it every 32 (as
    zlib's CRC-32 table is) gave wrong results from a second piece of 2^29 bytes on."""
    zeros = memoryview(bytes(1 << 29))
    head = crc32c.crc32c(b"tiersave")
    for n in ((1 << 29) - 4096, 1 << 29):
        assert crc32c_combine(head, crc32c.crc32c(zeros[:n]), n) == crc32c.crc32c(zeros[:n], head), n
