"""How a compressed shard is stored (format 3.0, docs/format.md section 10): its frames.

Scope: the ``encoding`` field of a shard object: the data class, its JSON form and its validation. A
compressed shard is a run of frames, each a range of the shard's *decoded* bytes stored on its own (zstd,
or verbatim when compressing did not shrink it), so that a reader can fetch and decode one checksum chunk
without the others. Anti-scope: compressing and decoding bytes (engine/codec.py), I/O.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from ..errors import FormatError

CODECS = frozenset({"zstd"})
"""The codecs a reader knows; any other is refused (a reader never guesses)."""
PLANES = frozenset({1, 2, 4, 8})
"""Byte-plane widths of the split (1: no split)."""
_HEX8 = re.compile(r"\A[0-9a-f]{8}\Z")  # \Z: "$" would let a trailing newline through


@dataclass(frozen=True, slots=True)
class Frame:
    """One stored frame: ``raw`` decoded bytes, ``stored`` bytes on the tier with CRC-32C ``crc`` (hex),
    byte-plane split of width ``planes`` before compression. ``stored == raw`` means stored verbatim."""

    raw: int
    stored: int
    crc: str
    planes: int

    @property
    def verbatim(self) -> bool:
        return self.stored == self.raw


@dataclass(frozen=True, slots=True)
class Encoding:
    """The frames of one compressed shard, in order; their ``raw`` lengths add up to the shard's size."""

    codec: str
    frames: tuple[Frame, ...]
    _raw_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _stored_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_raw_starts", (0, *accumulate(f.raw for f in self.frames)))
        object.__setattr__(self, "_stored_starts", (0, *accumulate(f.stored for f in self.frames)))

    @property
    def raw_size(self) -> int:
        return self._raw_starts[-1]

    @property
    def stored_size(self) -> int:
        """Bytes of the shard's file on the tier."""
        return self._stored_starts[-1]

    def raw_start(self, index: int) -> int:
        return self._raw_starts[index]

    def stored_start(self, index: int) -> int:
        return self._stored_starts[index]

    def frame_at(self, offset: int) -> int:
        """Index of the frame holding decoded byte ``offset`` (``0 <= offset < raw_size``)."""
        return bisect_right(self._raw_starts, offset) - 1

    def to_json(self) -> dict[str, Any]:
        return {"codec": self.codec, "frames": [[f.raw, f.stored, f.crc, f.planes] for f in self.frames]}


def parse_encoding(raw: Any, size: int, chunk_bytes: int, what: str, fail: Callable[[str], FormatError]) -> Encoding:
    """Validate a shard's ``encoding`` object against the shard's decoded ``size``.

    Every frame decodes to at most one checksum chunk (``chunk_bytes``) and is stored in at most as many
    bytes as it decodes to, so neither a reader's buffers nor a decoder's output can be made to grow past
    what the manifest's own sizes allow.
    """
    if not isinstance(raw, dict) or set(raw) != {"codec", "frames"}:
        raise fail(f"{what} must be an object with exactly the fields codec and frames")
    codec = raw["codec"]
    if codec not in CODECS:
        raise fail(f"{what}.codec {codec!r} is not supported (known: {', '.join(sorted(CODECS))})")
    if not isinstance(raw["frames"], list) or (size and not raw["frames"]):
        raise fail(f"{what}.frames must be a non-empty array")
    frames = []
    for i, item in enumerate(raw["frames"]):
        ok = isinstance(item, list) and len(item) == 4
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in (item[0], item[1], item[3]))
        if not ok or not isinstance(item[2], str) or not _HEX8.match(item[2]):
            raise fail(f"{what}.frames[{i}] must be [raw_bytes, stored_bytes, crc32c_hex, planes]")
        n, stored, crc, planes = item
        if not 0 < n <= chunk_bytes:
            raise fail(f"{what}.frames[{i}] decodes to {n} bytes, outside 1..{chunk_bytes} (checksum.chunk_bytes)")
        if not 0 < stored <= n:
            raise fail(f"{what}.frames[{i}] stores {stored} bytes, outside 1..{n} (its decoded length)")
        if planes not in PLANES:
            raise fail(f"{what}.frames[{i}] planes {planes} is not one of {sorted(PLANES)}")
        if stored == n and planes != 1:
            raise fail(f"{what}.frames[{i}] is stored verbatim (stored = decoded length) but declares {planes} planes")
        frames.append(Frame(n, stored, crc, planes))
    encoding = Encoding(codec, tuple(frames))
    if encoding.raw_size != size:
        raise fail(f"{what} frames decode to {encoding.raw_size} bytes, the shard has {size}")
    return encoding
