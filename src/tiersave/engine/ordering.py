"""What a staged write asks of writers whose writes wait for the bytes before them (an object store's upload window,
storage/s3/writer.py): to stop waiting when writes will not come in offset order, and to let waiting writes go when
the save is lost. Other writers have neither method and are left alone.

Scope: the two calls, by duck typing on the writer. Anti-scope: the window itself (storage/).
"""

from __future__ import annotations

from ..storage.base import BlobWriter


def expect_gaps(writers: list[BlobWriter]) -> None:
    """Writes of these writers' objects will not come in offset order: a writer that makes a write wait for the
    bytes before it (an object store's upload window) stops waiting, rather than wait for bytes that only a write
    queued behind the waiting ones brings."""
    for writer in writers:
        method = getattr(writer, "expect_gaps", None)
        if method is not None:
            method()


def interrupt(writers: list[BlobWriter], exc: BaseException) -> None:
    """A write of the save failed (or it was aborted): a writer whose later writes wait for its earlier bytes (an
    object store's upload window) lets them go with the error, since those bytes may never be written."""
    for writer in writers:
        method = getattr(writer, "interrupt", None)
        if method is not None:
            method(exc)
