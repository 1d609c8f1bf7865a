"""Object-store faults against the real SeaweedFS (RELIABILITY.md T7): the server SIGKILLed mid-upload,
throttling (503), connection resets and stalls from a TCP fault proxy, the uploading client SIGKILLed
mid-multipart-upload, a lost manifest response, and a second writer racing on the same step.

Every test checks the same invariants: a clean typed error or a successful retry, no manifest (no
visible checkpoint) unless every shard was complete, and no leftover multipart upload after abort or
cleanup. Figures (elapsed time, faults injected) are printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.commit import MarkerCommit, attempt_dirname
from tiersave.drain import copy_checkpoint
from tiersave.errors import AlreadyExistsError, StorageError, TransientStorageError
from tiersave.format.layout import step_dirname
from tiersave.storage.posix import LocalStorage
from tiersave.storage.s3 import S3Storage
from tiersave.testing.seaweed import FaultProxy, SeaweedServer

pytestmark = pytest.mark.s3

FAST_FAIL = {"part_size": "5MiB", "retries": "2", "retry_timeout": "5s", "timeout": "5s", "connect_timeout": "1s"}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A local checkpoint of step 1 with ~24 MiB in two shards (several 5 MiB parts each)."""
    root = tmp_path_factory.mktemp("src")
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(1024, 1536, generator=g) for i in range(4)}
    with tiersave.Checkpointer(root, chunk_bytes=2 << 20, max_shard_bytes=13 << 20) as ckpt:
        ckpt.save(1, state).result()
    return LocalStorage(root)


def assert_clean(storage: S3Storage) -> None:
    """Nothing visible, nothing left once leftovers are cleaned (objects and multipart uploads)."""
    assert Catalog(storage).steps() == []
    MarkerCommit(storage).clean_leftovers()
    assert MarkerCommit(storage).leftovers() == []
    assert storage.list_multipart_uploads("") == []
    assert [i.key for i in storage.list("")] == []


def proxied(server: SeaweedServer, proxy: FaultProxy, bucket: str, **options) -> S3Storage:
    return S3Storage.from_uri(
        f"s3://{bucket}/run?endpoint={proxy.endpoint}&" + "&".join(f"{k}={v}" for k, v in options.items()),
        env={},
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
    )


@pytest.fixture
def proxy(seaweed):
    with FaultProxy("127.0.0.1", seaweed.s3_port) as p:
        yield p


def test_server_killed_mid_upload_then_restarted(tmp_path, source):
    server = SeaweedServer(tmp_path / "weed")
    server.start()
    try:
        storage = server.storage("killed", "run", **FAST_FAIL)
        killed = threading.Event()

        def kill_at_a_third(done: int, total: int) -> None:
            if done > total // 3 and not killed.is_set():
                killed.set()
                server.kill()

        t0 = time.monotonic()
        with pytest.raises(StorageError) as info:
            copy_checkpoint(source, storage, 1, progress=kill_at_a_third)
        elapsed = time.monotonic() - t0
        print(f"\nserver SIGKILLed mid-upload: {type(info.value).__name__} after {elapsed:.1f} s: {info.value}")
        assert killed.is_set()
        assert isinstance(info.value, TransientStorageError)
        assert elapsed < 60
        server.start()  # same data directory and ports
        leftovers = MarkerCommit(storage).leftovers()
        print(f"after restart: {len(leftovers)} leftover attempt(s): {leftovers}")
        assert all(item.status == "dead" and not item.step_committed for item in leftovers)
        assert_clean(storage)
        result = copy_checkpoint(source, storage, 1, read_back=True)  # the retry succeeds
        assert result.read_back and Catalog(storage).verify(1).ok
    finally:
        server.kill()


def test_throttling_503_is_retried(seaweed, proxy, s3_bucket, source):
    seaweed.storage(s3_bucket)
    storage = proxied(seaweed, proxy, s3_bucket, **FAST_FAIL)
    proxy.set_mode("http503", count=2)  # within the 2 retries of a request
    t0 = time.monotonic()
    copy_checkpoint(source, storage, 1)
    print(f"\n503 SlowDown on {proxy.stats.faults} connections: retried, copied in {time.monotonic() - t0:.2f} s")
    assert proxy.stats.faults == 2
    assert Catalog(storage).verify(1).ok
    assert storage.list_multipart_uploads("") == []


@pytest.mark.parametrize("after_bytes", [300_000, 3_000_000])
def test_connection_reset_mid_upload(seaweed, proxy, s3_bucket, source, after_bytes):
    direct = seaweed.storage(s3_bucket, "run")
    storage = proxied(seaweed, proxy, s3_bucket, **FAST_FAIL)
    proxy.set_mode("reset", after_bytes=after_bytes, count=2)
    failure: StorageError | None = None
    try:
        copy_checkpoint(source, storage, 1)
    except StorageError as exc:
        failure = exc
    outcome = "retried and committed" if failure is None else f"clean failure: {type(failure).__name__}"
    if failure is not None:
        assert isinstance(failure, TransientStorageError)
        assert Catalog(direct).steps() == []
    print(f"\nreset after {after_bytes} bytes on {proxy.stats.faults} connection(s): {outcome}")
    assert proxy.stats.faults >= 1
    if Catalog(direct).steps():
        assert Catalog(direct).verify(1).ok
    MarkerCommit(direct).clean_leftovers()
    assert direct.list_multipart_uploads("") == []
    assert MarkerCommit(direct).leftovers() == []


def test_persistent_503_mid_upload_fails_cleanly_and_cleanup_aborts_uploads(seaweed, proxy, s3_bucket, source):
    direct = seaweed.storage(s3_bucket, "run")
    storage = proxied(seaweed, proxy, s3_bucket, **FAST_FAIL)
    storm = threading.Event()

    def throttle_at_a_third(done: int, total: int) -> None:
        if done > total // 3 and not storm.is_set():
            storm.set()
            proxy.set_mode("http503")

    t0 = time.monotonic()
    with pytest.raises(TransientStorageError):
        copy_checkpoint(source, storage, 1, progress=throttle_at_a_third)
    elapsed = time.monotonic() - t0
    proxy.set_mode("pass")
    uploads = direct.list_multipart_uploads("")
    print(f"\npersistent 503: failed after {elapsed:.1f} s; {len(uploads)} unfinished upload(s) before cleanup")
    assert elapsed < 60
    assert not direct.exists(f"{step_dirname(1)}/manifest.json")
    assert_clean(direct)


def test_stalled_server_times_out(seaweed, proxy, s3_bucket):
    direct = seaweed.storage(s3_bucket, "run")
    direct.put("obj", b"payload")
    storage = proxied(seaweed, proxy, s3_bucket, retries="1", timeout="1s", connect_timeout="1s", retry_timeout="3s")
    proxy.set_mode("stall")
    t0 = time.monotonic()
    with pytest.raises(TransientStorageError):
        storage.get("obj")
    elapsed = time.monotonic() - t0
    print(f"\nstalled server: TransientStorageError after {elapsed:.1f} s")
    assert elapsed < 15
    proxy.set_mode("pass")
    assert storage.get("obj") == b"payload"


def test_uploading_client_killed_mid_multipart_upload(seaweed, s3_bucket, tmp_path):
    storage = seaweed.storage(s3_bucket, "run", part_size="5MiB")
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from tiersave.commit import MarkerCommit
        from tiersave.storage.s3 import S3Storage
        storage = S3Storage.from_uri({storage.uri + "?endpoint=" + seaweed.endpoint + "&part_size=5MiB"!r})
        prefix = MarkerCommit(storage).begin(7)
        writer = storage.open_writer(prefix + "/shard-00000-000.bin")
        writer.write_at(0, memoryview(os.urandom(11 << 20)))  # two full parts: the upload is under way
        while not storage.list_multipart_uploads(""):
            time.sleep(0.05)
        print("uploading", flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, **seaweed.env()}
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "uploading"
    finally:
        child.kill()
        child.wait()
    uploads = storage.list_multipart_uploads("")
    leftovers = MarkerCommit(storage).leftovers()
    print(f"\nclient SIGKILLed: {len(uploads)} unfinished upload(s), leftovers {leftovers}")
    assert len(uploads) == 1 and uploads[0].key.startswith(f"{step_dirname(7)}/attempt-{child.pid}-")
    assert [(item.status, item.uploads, item.objects) for item in leftovers] == [("dead", 1, 0)]
    assert not storage.exists(uploads[0].key)  # an unfinished upload is invisible
    assert_clean(storage)


def test_second_writer_racing_on_a_step_never_overwrites(seaweed, s3_bucket):
    storage = seaweed.storage(s3_bucket, "run")
    commit_a, commit_b = MarkerCommit(storage), MarkerCommit(storage)
    prefix_a, prefix_b = commit_a.begin(5), commit_b.begin(5)  # both see step 5 uncommitted
    assert prefix_a != prefix_b
    for prefix, fill in ((prefix_a, b"A"), (prefix_b, b"B")):
        writer = storage.open_writer(f"{prefix}/shard-00000-000.bin")
        writer.write_at(0, memoryview(fill * 4096))
        writer.finish(4096)
    manifest_a = _manifest(5, commit_a.shard_file(prefix_a, "shard-00000-000.bin"), b"A" * 4096)
    manifest_b = _manifest(5, commit_b.shard_file(prefix_b, "shard-00000-000.bin"), b"B" * 4096)
    commit_a.commit(prefix_a, 5, manifest_a)
    with pytest.raises(AlreadyExistsError, match="committed by another writer"):
        commit_b.commit(prefix_b, 5, manifest_b)
    commit_b.abort(prefix_b)
    assert storage.get(f"{step_dirname(5)}/manifest.json") == manifest_a
    assert storage.get(f"{prefix_a}/shard-00000-000.bin") == b"A" * 4096
    assert Catalog(storage).verify(5).ok
    with pytest.raises(AlreadyExistsError):
        MarkerCommit(storage).begin(5)  # a later save of step 5 is refused up front
    assert MarkerCommit(storage).leftovers() == []


def test_resave_after_crashed_attempt_and_lost_manifest_response(seaweed, s3_bucket):
    storage = seaweed.storage(s3_bucket, "run")
    from tiersave.commit import _host_id

    crashed = f"{step_dirname(9)}/{attempt_dirname(f'999999999-{_host_id()}-{uuid.uuid4().hex[:16]}')}"
    storage.put(f"{crashed}/shard-00000-000.bin", b"\x00" * 4096)  # left by a process that died
    commit = MarkerCommit(storage)
    prefix = commit.begin(9)  # an uncommitted attempt does not block a re-save
    storage.put(f"{prefix}/shard-00000-000.bin", b"C" * 4096)
    manifest = _manifest(9, commit.shard_file(prefix, "shard-00000-000.bin"), b"C" * 4096)

    class LostResponse:
        """The manifest PUT lands but its response is lost; the retry sees 412 (the object exists)."""

        def __init__(self, inner):
            self.inner, self.uri, self.capabilities = inner, inner.uri, inner.capabilities

        def put(self, key, data, *, mode="overwrite"):
            self.inner.put(key, data, mode=mode)
            if mode == "create":
                raise AlreadyExistsError("retried PUT: 412", tier=self.uri, key=key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    MarkerCommit(LostResponse(storage)).commit(prefix, 9, manifest)  # reported committed: it is ours
    assert Catalog(storage).verify(9).ok
    leftovers = MarkerCommit(storage).leftovers()
    assert [(i.prefix, i.status, i.step_committed) for i in leftovers] == [(crashed, "dead", True)]
    assert MarkerCommit(storage).clean_leftovers() == [crashed]
    assert Catalog(storage).verify(9).ok and MarkerCommit(storage).leftovers() == []


def _manifest(step: int, shard_file: str, data: bytes) -> bytes:
    from tiersave.format.checksum import crc32c_hex
    from tiersave.format.manifest import Manifest, ShardInfo, TensorEntry

    entry = TensorEntry("t", "uint8", (len(data),), 0, 0, len(data), (crc32c_hex(data),))
    return Manifest(
        step=step, shards=(ShardInfo(shard_file, 0, len(data)),), tensors={"t": entry}, tree={"$tensor": "t"}
    ).to_json()
