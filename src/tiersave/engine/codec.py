"""Compression of shards for the tiers where bandwidth is scarce (docs/format.md section 10).

Scope: cutting a shard into frames along its checksum chunks, the byte-plane split of floating-point data,
zstd compression of one frame, and :class:`DecodingReader`, a ``BlobReader`` that serves a compressed
shard's decoded bytes at their decoded offsets, checking each frame's stored bytes before decoding them.
Anti-scope: which tier compresses (tiers.py), scheduling the copy (drain.py), the manifest field
(format/encoding.py). The ``zstandard`` package is imported only when a frame is encoded or decoded.

Thread safety: the functions keep one compressor and one decompressor per thread; a ``DecodingReader``
may be read from several threads.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, CorruptCheckpointError
from ..format.checksum import chunk_ranges, crc32c_hex
from ..format.dtypes import lookup
from ..format.encoding import Encoding, Frame
from ..format.manifest import Manifest
from ..storage.base import BlobReader

if TYPE_CHECKING:
    import zstandard

__all__ = ["CODEC_NAMES", "DecodingReader", "encode_frame", "plan_frames", "require_codec"]

CODEC_NAMES = ("zstd",)
LEVEL = 1
"""zstd level: 1 keeps a drain thread's compression well above an object store's per-thread upload rate;
higher levels gained little on checkpoint data (docs/benchmarks.md, compression)."""
_local = threading.local()


def require_codec(codec: str) -> None:
    """Raise :class:`ConfigError` unless ``codec`` is known and its library is installed."""
    if codec not in CODEC_NAMES:
        raise ConfigError(f"compress must be one of {', '.join(map(repr, CODEC_NAMES))}, 'auto' or None, got {codec!r}")
    _zstd()


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise ConfigError(
            "compressed shards need the zstandard package: pip install 'tiersave[zstd]' (zstandard==0.25.0)"
        ) from None
    return zstandard


def _compressor() -> zstandard.ZstdCompressor:
    c: zstandard.ZstdCompressor | None = getattr(_local, "compressor", None)
    if c is None:
        c = _local.compressor = _zstd().ZstdCompressor(level=LEVEL, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if d is None:
        d = _local.decompressor = _zstd().ZstdDecompressor()
    return d


def _planes_of(dtype: str) -> int:
    d = lookup(dtype)
    floating = d is not None and (d.name.startswith("float") or d.name.startswith("bfloat"))
    return d.itemsize if d is not None and floating and d.itemsize in (2, 4, 8) else 1


def plan_frames(manifest: Manifest, shard: int) -> list[tuple[int, int, int]]:
    """The frames of a shard as ``(decoded offset, length, planes)``, covering it exactly.

    Every checksum chunk lies inside one frame and no frame exceeds ``chunk_bytes``, so a reader decodes
    one frame per chunk. Consecutive small tensors of one split width (and their padding) share a frame:
    the element size of floating-point data, else 1 (no split).
    """
    size = manifest.shards[shard].size
    limit = manifest.chunk_bytes
    cuts: list[tuple[int, int]] = []  # (start of a chunk, its planes)
    for t in manifest.tensors.values():
        if t.shard == shard and t.nbytes:
            cuts.extend((t.offset + off, _planes_of(t.dtype)) for off, _ in chunk_ranges(t.nbytes, limit))
    cuts.sort()
    if not cuts or cuts[0][0] > 0:
        cuts.insert(0, (0, 1))
    frames: list[tuple[int, int, int]] = []
    start = length = 0
    planes = 1
    for i, (begin, width) in enumerate(cuts):
        end = cuts[i + 1][0] if i + 1 < len(cuts) else size  # a chunk and the padding after it
        if length and length + end - begin <= limit and width == planes:
            length += end - begin
            continue
        if length:
            frames.append((start, length, planes))
        if end - begin > limit:  # a gap longer than a chunk: cut it into frames of its own
            pieces = [(begin + off, n, width) for off, n in chunk_ranges(end - begin, limit)]
            frames.extend(pieces[:-1])
            begin, width = pieces[-1][0], pieces[-1][2]
        start, length, planes = begin, end - begin, width
    if length:
        frames.append((start, length, planes))
    return frames


def split_planes(data: memoryview, width: int) -> bytes:
    """Byte ``i`` of every ``width``-byte element first, for each ``i``; a tail shorter than one element last."""
    if width == 1:
        return bytes(data)
    src = np.frombuffer(data, dtype=np.uint8)
    whole = len(src) - len(src) % width
    out = np.empty(len(src), dtype=np.uint8)
    plane = whole // width
    for i in range(width):  # one strided copy per plane: faster than a transposed copy of the whole
        out[i * plane : (i + 1) * plane] = src[i:whole:width]
    out[whole:] = src[whole:]
    return out.tobytes()


def join_planes(data: bytes, width: int) -> bytearray:
    """Undo :func:`split_planes`."""
    out = bytearray(data)
    if width > 1:
        src = np.frombuffer(data, dtype=np.uint8)
        dst = np.frombuffer(out, dtype=np.uint8)
        whole = len(src) - len(src) % width
        plane = whole // width
        for i in range(width):
            dst[i:whole:width] = src[i * plane : (i + 1) * plane]
    return out


def encode_frame(data: memoryview, planes: int) -> tuple[bytes, Frame]:
    """Compress one frame's decoded bytes; stored verbatim (``planes`` 1) when compression does not shrink it."""
    packed = _compressor().compress(split_planes(data, planes))
    if len(packed) >= len(data):
        stored = bytes(data)
        return stored, Frame(len(data), len(stored), crc32c_hex(stored), 1)
    return packed, Frame(len(data), len(packed), crc32c_hex(packed), planes)


def decode_frame(stored: bytes | bytearray, frame: Frame, where: str) -> bytearray:
    """Check a frame's stored bytes against their CRC-32C, then decode them to exactly ``frame.raw`` bytes.

    Raises:
        CorruptCheckpointError: the stored bytes do not match their checksum, or do not decode to the
            declared length (the decoder never allocates more than that).
    """
    actual = crc32c_hex(stored)
    if actual != frame.crc:
        raise CorruptCheckpointError(f"{where}: stored bytes fail their checksum (expected {frame.crc}, got {actual})")
    if frame.verbatim:
        return bytearray(stored)
    zstd = _zstd()
    try:
        declared = zstd.frame_content_size(stored)
        if declared != frame.raw:
            raise CorruptCheckpointError(f"{where}: the zstd frame declares {declared} bytes, expected {frame.raw}")
        plain = _decompressor().decompress(stored, max_output_size=frame.raw)
    except zstd.ZstdError as exc:
        raise CorruptCheckpointError(f"{where}: the zstd frame does not decode ({exc})") from None
    if len(plain) != frame.raw:
        raise CorruptCheckpointError(f"{where}: decoded {len(plain)} bytes, expected {frame.raw}")
    return join_planes(plain, frame.planes)


class DecodingReader:
    """A ``BlobReader`` over a compressed shard: ``size`` and offsets are the decoded ones.

    A read decodes each frame it touches (checksum of the stored bytes first); the last decoded frame is
    kept, so reads of consecutive pieces of one frame decode it once.
    """

    def __init__(self, inner: BlobReader, encoding: Encoding, *, where: str, step: int | None, file: str) -> None:
        if inner.size != encoding.stored_size:
            inner.close()
            raise CorruptCheckpointError(
                f"{where}: compressed shard {file} is {inner.size} bytes, its frames say {encoding.stored_size} "
                "(truncated, extended or replaced)",
                step=step,
                file=file,
            )
        self.inner = inner
        self.key = inner.key
        self.size = encoding.raw_size
        self.encoding = encoding
        self._where, self._step, self._file = where, step, file
        self._last: tuple[int, bytearray] | None = None
        self._lock = threading.Lock()

    def read_into(self, offset: int, out: memoryview) -> None:
        end = offset + len(out)
        if offset < 0 or end > self.size:
            raise CorruptCheckpointError(
                f"{self._where}: read of [{offset}, {end}) past the decoded end ({self.size}) of {self._file}",
                step=self._step,
                file=self._file,
            )
        pos = offset
        while pos < end:
            index = self.encoding.frame_at(pos)
            start = self.encoding.raw_start(index)
            plain = self._frame(index)
            n = min(end, start + len(plain)) - pos
            out[pos - offset : pos - offset + n] = plain[pos - start : pos - start + n]
            pos += n

    def _frame(self, index: int) -> bytearray:
        with self._lock:
            last = self._last
        if last is not None and last[0] == index:
            return last[1]
        frame = self.encoding.frames[index]
        stored = bytearray(frame.stored)
        self.inner.read_into(self.encoding.stored_start(index), memoryview(stored))
        where = f"{self._where}, shard {self._file}, frame {index} (decoded bytes {self.encoding.raw_start(index)}..)"
        try:
            plain = decode_frame(stored, frame, where)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(str(exc), step=self._step, file=self._file) from None
        with self._lock:
            self._last = (index, plain)
        return plain

    def close(self) -> None:
        self.inner.close()
