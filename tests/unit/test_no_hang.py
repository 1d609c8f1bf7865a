"""Waits that must end: an event log path that is a FIFO, a submission re-entering the pool's lock (a SIGTERM
handler on the thread inside ``submit``), and an S3 listing whose server repeats its page."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from helpers import within
from tiersave.engine.pool import DaemonThreadPool
from tiersave.events import EventLog
from tiersave.storage.s3 import S3Storage


def test_an_event_log_that_is_a_fifo_is_not_written_and_does_not_block(tmp_path, caplog):
    path = tmp_path / "tiersave-events.jsonl"
    os.mkfifo(path)
    done = threading.Event()

    def append() -> None:
        EventLog(path).append({"step": 1, "outcome": "committed"})
        done.set()

    thread = threading.Thread(target=append, daemon=True)
    with caplog.at_level(logging.WARNING, logger="tiersave.events"):
        thread.start()
        finished = done.wait(10)
        if not finished:  # the old open blocked for a reader: give it one so the thread ends
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            thread.join(10)
            os.close(fd)
    assert finished, "appending to a FIFO blocked"
    assert "could not append to the event log" in caplog.text


def test_a_submission_from_inside_a_submission_does_not_deadlock():
    """A signal handler runs on the main thread between any two bytecodes, also while that thread is inside
    submit() holding the pool's lock; a handler that submits must not wait for that lock forever."""
    pool = DaemonThreadPool(1, "reentry")
    try:
        with pool._lock:  # the main thread, interrupted inside submit()
            future = pool.submit(lambda: 42)  # the handler's submission
        assert future.result(10) == 42
    finally:
        pool.shutdown(wait=False)


def test_a_multipart_listing_whose_server_repeats_its_page_ends(monkeypatch):
    storage = S3Storage.from_uri(
        "s3://bucket/run?endpoint=http://127.0.0.1:9", env={}, access_key_id="a", secret_access_key="b"
    )
    page = (
        b'<?xml version="1.0"?><ListMultipartUploadsResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        b"<IsTruncated>true</IsTruncated><NextKeyMarker>run/k</NextKeyMarker><NextUploadIdMarker>u1"
        b"</NextUploadIdMarker><Upload><Key>run/k</Key><UploadId>u1</UploadId>"
        b"<Initiated>2026-11-25T00:00:00.000Z</Initiated></Upload></ListMultipartUploadsResult>"
    )
    calls: list[dict] = []
    control = storage._control_client()

    def request(method, key, query, **kwargs):
        calls.append(query)
        if len(calls) > 5:
            pytest.fail("the listing kept asking for the same page")
        return None, page

    monkeypatch.setattr(control, "request", request)
    uploads = storage.list_multipart_uploads("")
    assert [(u.key, u.upload_id) for u in uploads] == [("k", "u1")]
    assert len(calls) == 2  # the first page, then the same page again: stop


def test_a_replication_task_that_fails_unexpectedly_still_ends_its_replica_future():
    """``<tier>.replica``'s future was resolved only on the paths the task expected (peers that failed with a
    TiersaveError); any other error left ``tier_result(...)`` waiting for good."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from tiersave.replication import Replicas

    def broken(step, chain, future):
        raise KeyError("node 3")  # e.g. a layout without this node's address

    future: Future = Future()
    future.set_running_or_notify_cancel()
    with pytest.raises(KeyError):
        Replicas._replicate(SimpleNamespace(_replicate_step=broken), 7, None, future)
    assert isinstance(future.exception(timeout=0), KeyError)


def test_a_drain_whose_chunk_fails_tells_its_writers_once():
    """The drain's pump calls ``on_error`` once, with the first failure: the copy interrupts its writers there,
    so a write waiting in an upload window for the failed chunk's bytes ends instead of waiting for them."""
    from concurrent.futures import ThreadPoolExecutor

    from tiersave.drain import _Chunk, _Pump

    told: list[BaseException] = []

    def work(chunk, view) -> None:
        if chunk.offset == 0:
            raise ValueError("chunk 0 failed its checksum")

    with ThreadPoolExecutor(2) as pool:
        pump = _Pump(pool, 2, 4096, told.append)
        chunks = [_Chunk(0, offset, 4096, "", "w", i) for i, offset in enumerate(range(0, 8 * 4096, 4096))]
        with pytest.raises(ValueError, match="checksum"):
            pump.run(chunks, work)
    assert [str(e) for e in told] == ["chunk 0 failed its checksum"]


def test_a_demo_worker_that_writes_much_to_stderr_and_fails_is_reported_not_waited_for():
    """The demo read its worker's stderr pipe only after the worker ended: a worker that wrote more than a pipe
    holds (a long traceback, warnings) blocked on it, and the demo waited for its stdout for good."""
    import subprocess
    import sys
    import tempfile

    from tiersave.demo.run import DemoError, RunLog, _follow, _Worker

    script = "import sys; sys.stderr.write('x' * 1_000_000 + 'the last words'); sys.exit(3)"
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, text=True)
        with pytest.raises(DemoError, match=r"exit code 3:\n.*the last words"):
            _follow(_Worker(proc, err), RunLog())


def test_a_fifo_where_a_lightning_pointer_or_a_cache_is_expected_does_not_block(tmp_path, monkeypatch):
    """A FIFO among the checkpoint files (the Lightning plugin reads every ``.ckpt`` it lists) or at a cache's
    path blocked its reader until something wrote to it; each is now not a pointer, or no cache."""
    from tiersave.errors import FormatError
    from tiersave.integrations.lightning import read_pointer
    from tiersave.storage.posix import calibration

    os.mkfifo(tmp_path / "last.ckpt")
    with pytest.raises(FormatError, match="not a tiersave checkpoint pointer"):
        within(10, lambda: read_pointer(tmp_path / "last.ckpt"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache" / "tiersave").mkdir(parents=True)
    os.mkfifo(calibration.cache_path())
    assert within(10, calibration._load_cache) == {}
    from tiersave import autocompress

    monkeypatch.setattr(autocompress, "_calibration", None)  # not measured in this process yet
    os.mkfifo(tmp_path / "cache" / "tiersave" / "codec-calibration.json")
    assert within(10, autocompress.codec_calibration).ratio > 0  # measured; the FIFO is no cache, and left alone
