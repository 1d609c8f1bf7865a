"""One S3 object written with ``write_at`` from many threads as one multipart upload: :class:`S3BlobWriter`.

Scope: assembling out-of-order writes into part-sized blocks, back-pressure that bounds the buffered bytes,
handing finished parts to obstore's multipart upload zero-copy and recycling their buffers once obstore
let go of them, the single-PUT path for an object that fits in one part, and cleanup on abort.
Anti-scope: the upload protocol itself (obstore), listing and aborting uploads (``control.py``),
checksums and the commit (the engine and ``tiersave.commit``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import obstore
from obstore.store import S3Store

from ...errors import ConfigError, ObjectNotFoundError, StorageError, TiersaveError
from .control import S3Control
from .errors import map_s3_error, mapped_errors
from .options import MAX_PARTS, S3Options
from .views import byte_view

log = logging.getLogger(__name__)


class _Block:
    """One part being assembled. ``buf`` may be recycled (dirty): bytes never written are zeroed only
    when a partial block is handed over (``zero_gaps``), so a full block costs no extra pass."""

    __slots__ = ("buf", "filled", "spans")

    def __init__(self, buf: bytearray) -> None:
        self.buf = buf
        self.filled = 0
        self.spans: list[tuple[int, int]] = []

    def zero_gaps(self, length: int) -> None:
        buf, zeros = memoryview(self.buf), memoryview(_zeros(len(self.buf)))
        cursor = 0
        for lo, hi in sorted(self.spans):
            if lo > cursor:
                buf[cursor:lo] = zeros[: lo - cursor]
            cursor = max(cursor, hi)
        if cursor < length:
            buf[cursor:length] = zeros[: length - cursor]


_ZEROS: dict[int, bytes] = {}


def _zeros(size: int) -> bytes:
    block = _ZEROS.get(size)
    if block is None:
        block = _ZEROS[size] = bytes(size)
    return block


class _Aborted(Exception):
    """Raised inside the part iterator to make obstore abandon (and abort) the multipart upload."""


class S3BlobWriter:
    """One object written with ``write_at`` from many threads, uploaded as one multipart upload.

    Writes are copied into part-sized blocks; a block whose every byte was written, and all before it,
    is handed to obstore's multipart upload (``upload_concurrency`` parts in flight). Memory is bounded:
    a ``write_at`` starting ``write_buffer_bytes`` or more past the first block not yet handed over waits
    (back-pressure), so at most ``write_buffer_bytes`` plus one write are buffered. A write at the first
    missing byte never waits, so writers that issue their writes roughly in offset order (as the tiersave
    engines do, from a FIFO pool) cannot deadlock. A byte below the window that never comes (an earlier write
    failed, or was never issued) cannot hang a waiting write: ``interrupt`` ends the wait with the caller's
    error, and a wait that sees the window not move for twice the request timeout plus the retry time raises
    ``StorageError``. ``finish`` fills gaps with zeros. An object that fits in
    one part is sent with a single PUT.

    Call protocol: ``write_at`` (any threads, disjoint ranges) -> ``finish(size)`` once, after every write
    returned; ``abort()`` any time, idempotent. Nothing is visible before ``finish`` returns.

    Args:
        store: the obstore client of the storage that opened the writer.
        key: the object key relative to the storage root.
        options: the storage's options (part size, buffer bound, concurrency, timeouts; ``uri`` for messages).
        control: returns the storage's signed-request client, used only by ``abort`` to remove an upload
            that obstore's own abort left behind.
    """

    def __init__(self, store: S3Store, key: str, *, options: S3Options, control: Callable[[], S3Control]) -> None:
        self.key = key
        self._store = store
        self._options = options
        self._uri = options.uri
        self._control = control
        opts = options
        self._part = opts.part_bytes
        self._window = opts.write_buffer_bytes
        self._max_bytes = MAX_PARTS * self._part
        self._cond = threading.Condition()
        self._blocks: dict[int, _Block] = {}
        self._next = 0  # first block not yet handed to the upload
        self._size: int | None = None  # set by finish
        self._state = "open"  # open | finishing | done | aborted | failed
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._sent: list[tuple[bytearray, memoryview]] = []  # handed to obstore; reusable once released
        self._max_sent = max(2, self._window // self._part)

    # -- producer side ----------------------------------------------------------------------------

    def write_at(self, offset: int, data: memoryview) -> None:
        view = byte_view(data)
        if not view:
            return
        end = offset + len(view)
        if offset < 0:
            raise ConfigError(f"{self.key!r}: negative offset {offset}")
        if end > self._max_bytes:
            raise ConfigError(
                f"{self.key!r} on {self._uri}: byte {end} is past the {MAX_PARTS}-part limit of "
                f"{self._max_bytes} bytes at part_size={self._part}; raise part_size or lower max_shard_bytes"
            )
        part = self._part
        first, last = offset // part, (end - 1) // part
        with self._cond:
            stall_s = self._options.timeout_s * 2 + self._options.retry_timeout_s  # an upload's longest request
            deadline, mark = time.monotonic() + stall_s, self._next
            while True:
                self._check_writable()
                if offset < self._next * part + self._window:
                    break
                if self._next != mark:  # the window moved: the wait starts again
                    deadline, mark = time.monotonic() + stall_s, self._next
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageError(
                        f"{self.key!r} on {self._uri}: a write at byte {offset} waited {stall_s:.0f} s for the bytes "
                        f"from byte {self._next * part} on, which no write brought (an earlier write of this object "
                        "failed or was never issued); nothing of the object is visible",
                        tier=self._uri,
                        key=self.key,
                    )
                self._cond.wait(left)
            if first < self._next:
                raise StorageError(
                    f"{self.key!r}: write at byte {offset} after that part was uploaded (overlapping writes?)",
                    tier=self._uri,
                    key=self.key,
                )
            blocks = []
            for index in range(first, last + 1):
                block = self._blocks.get(index)
                if block is None:
                    block = self._blocks[index] = _Block(self._new_buffer())
                blocks.append(block)
        # Copy outside the lock: blocks are not handed over before their bytes are counted below.
        spans = []
        for index, block in zip(range(first, last + 1), blocks):
            lo = max(offset, index * part)
            hi = min(end, (index + 1) * part)
            # memoryview slice assignment is a plain memcpy; bytearray slice assignment is ~15x slower.
            memoryview(block.buf)[lo - index * part : hi - index * part] = view[lo - offset : hi - offset]
            spans.append((block, lo - index * part, hi - index * part))
        with self._cond:
            for block, lo, hi in spans:
                block.filled += hi - lo
                block.spans.append((lo, hi))
            self._cond.notify_all()
            start_upload = self._thread is None and self._state == "open" and self._full(0)
            if start_upload:
                self._start_upload()

    def _new_buffer(self) -> bytearray:
        """A part buffer: a recycled one if any (fresh pages cost a page fault each), else a new one.

        obstore sends parts zero-copy: it holds the buffer we yielded until that part's upload is done.
        ``memoryview.release()`` fails while anyone still holds a buffer from the view, so a buffer is
        reused only after obstore let go of it.
        """
        for i, (buf, view) in enumerate(self._sent):
            try:
                view.release()
            except BufferError:
                continue  # still being uploaded
            del self._sent[i]
            return buf
        return bytearray(self._part)

    def expect_gaps(self) -> None:
        """Writes of this object will not come in offset order (a byte is written after writes far past it: a
        piece an incremental save fills from its base at the end, a lazy save's phases): no write waits for the
        window any more. Memory is then bounded by the object's size instead of ``write_buffer_bytes``."""
        with self._cond:
            self._window = self._max_bytes
            self._cond.notify_all()

    def interrupt(self, exc: BaseException) -> None:
        """The object will not be finished (another write of it failed): writes waiting for the window raise
        ``exc`` now, as does any later one. ``abort`` still follows, and removes the upload."""
        with self._cond:
            if self._error is None and self._state == "open":
                self._error = exc
            self._cond.notify_all()

    def _check_writable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._state != "open":
            raise StorageError(f"{self.key!r}: write after finish/abort ({self._state})", tier=self._uri, key=self.key)

    def _full(self, index: int) -> bool:
        block = self._blocks.get(index)
        return block is not None and block.filled >= self._part

    def _start_upload(self) -> None:
        thread = threading.Thread(target=self._upload, name=f"tiersave-s3-put:{self.key}", daemon=True)
        self._thread = thread
        thread.start()

    # -- consumer side (the upload thread) --------------------------------------------------------

    def _parts(self) -> Iterator[memoryview]:
        part = self._part
        while True:
            with self._cond:
                while True:
                    if self._state == "aborted":
                        raise _Aborted
                    index = self._next
                    if self._size is not None:
                        nblocks = -(-self._size // part)
                        if index >= nblocks:
                            return
                        block = self._blocks.pop(index, None)
                        length = min(part, self._size - index * part)
                        if block is None:
                            buf = bytearray(part)
                        else:
                            if block.filled < part:
                                block.zero_gaps(length)
                            buf = block.buf
                        break
                    if self._full(index):
                        buf = self._blocks.pop(index).buf
                        length = part
                        break
                    self._cond.wait()
                self._next = index + 1
                self._cond.notify_all()  # the window moved: waiting writers may go on
            view = memoryview(buf)[:length]
            yield view
            if len(buf) == part:
                with self._cond:
                    if len(self._sent) < self._max_sent:
                        self._sent.append((buf, view))

    def _upload(self) -> None:
        opts = self._options
        try:
            obstore.put(
                self._store,
                self.key,
                self._parts(),
                use_multipart=True,
                chunk_size=self._part,
                max_concurrency=opts.upload_concurrency,
            )
        except BaseException as exc:
            with self._cond:
                if self._state != "aborted":
                    self._error = (
                        exc
                        if isinstance(exc, TiersaveError)
                        else map_s3_error(exc, tier=self._uri, key=self.key, action="uploading", options=self._options)
                    )
                    self._state = "failed"
                self._blocks.clear()
                self._cond.notify_all()

    # -- end --------------------------------------------------------------------------------------

    def finish(self, size: int) -> None:
        if not isinstance(size, int) or size < 0 or size > self._max_bytes:
            raise ConfigError(f"{self.key!r}: invalid final size {size!r}")
        with self._cond:
            self._check_writable()
            self._size = size
            self._state = "finishing"
            self._cond.notify_all()
            thread = self._thread
            if thread is None and size > self._part:
                self._start_upload()
                thread = self._thread
            small = None
            if thread is None:
                block = self._blocks.pop(0, None)
                if block is not None and block.filled < self._part:
                    block.zero_gaps(size)
                small = memoryview(block.buf)[:size] if block is not None else memoryview(bytearray(size))
        if small is not None:
            try:
                with mapped_errors(self._uri, "writing", self.key, self._options):
                    obstore.put(self._store, self.key, small, use_multipart=False)
            except BaseException:
                with self._cond:
                    self._state = "failed"
                raise
        elif thread is not None:
            thread.join()
        with self._cond:
            if self._error is not None:
                raise self._error
            if self._state == "aborted":
                raise StorageError(f"{self.key!r}: aborted during finish", tier=self._uri, key=self.key)
            self._state = "done"
            self._sent = []
            self._blocks.clear()  # writes past ``size``, if any, were cut off

    def abort(self) -> None:
        with self._cond:
            previous = self._state
            self._state = "aborted"
            self._blocks.clear()
            self._sent = []
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # obstore abandons the upload and sends AbortMultipartUpload when the part iterator raises.
            thread.join(self._options.timeout_s * 2 + self._options.retry_timeout_s)
        if previous in ("done", "aborted"):
            if previous == "done":
                with (
                    contextlib.suppress(ObjectNotFoundError),
                    mapped_errors(self._uri, "deleting", self.key, self._options),
                ):
                    obstore.delete(self._store, self.key)
            return
        if thread is not None and previous in ("failed", "finishing", "open"):
            # If obstore's own abort could not reach the service, make one more attempt (best effort).
            try:
                control = self._control()
                for upload in control.list_uploads(self.key):
                    if upload.key == self.key:
                        control.abort_upload(upload.key, upload.upload_id)
            except (ConfigError, StorageError) as exc:
                log.debug("could not check for a leftover upload of %s: %s", self.key, exc)
