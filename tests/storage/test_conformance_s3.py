"""S3Storage passes the storage conformance suite against a real SeaweedFS server."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tiersave.storage.s3 import S3Storage
from tiersave.testing.conformance import StorageConformanceTests

pytestmark = pytest.mark.s3


class TestS3Storage(StorageConformanceTests):
    large_object_bytes = 12 << 20  # three 5 MiB parts (the fixture's part size): a real multipart upload

    @pytest.fixture
    def storage(self, s3_storage):
        return s3_storage

    def reopen(self, storage):
        opts = storage.options
        return S3Storage(opts)  # same options (credentials are not in the URI)


def test_recycled_part_buffers_read_as_zeros_in_gaps(s3_storage):
    """Part buffers are reused once obstore has copied them; gaps in a later part must still be zeros."""
    import time

    part = s3_storage.options.part_bytes
    writer = s3_storage.open_writer("recycled.bin")
    writer.write_at(0, memoryview(b"\xff" * (3 * part)))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until obstore let go of a sent part
        if writer._sent:
            try:
                writer._sent[0][1].release()
                break
            except BufferError:
                pass
        time.sleep(0.01)
    recycled = {id(buf) for buf, _ in writer._sent}
    writer.write_at(4 * part + 100, memoryview(b"\x07" * 10))
    assert id(writer._blocks[4].buf) in recycled, "the sparse part did not get a recycled (dirty) buffer"
    writer.finish(5 * part + 4096)
    data = s3_storage.get("recycled.bin")
    expected = bytearray(5 * part + 4096)
    expected[: 3 * part] = b"\xff" * (3 * part)
    expected[4 * part + 100 : 4 * part + 110] = b"\x07" * 10
    assert data == expected


def test_uri_options_and_redaction(seaweed):
    from tiersave.errors import ConfigError
    from tiersave.storage import open_storage
    from tiersave.storage.s3 import S3Options

    opts = S3Options.from_uri(
        "s3://my-bucket/a/b/?endpoint=http://h:1/&region=eu-west-1&part_size=8MiB&retries=3&timeout=90s"
        "&access_key_id=AK&secret_access_key=SECRET&upload_concurrency=4&unsigned_payload=false",
        env={},
    )
    assert (opts.bucket, opts.prefix, opts.endpoint, opts.region) == ("my-bucket", "a/b", "http://h:1", "eu-west-1")
    assert (opts.part_bytes, opts.max_retries, opts.timeout_s, opts.upload_concurrency) == (8 << 20, 3, 90.0, 4)
    assert opts.http_allowed and not opts.unsigned_payload
    assert opts.uri == "s3://my-bucket/a/b" and "SECRET" not in repr(opts)
    env = {
        "AWS_ENDPOINT_URL_S3": "http://e:2",
        "AWS_REGION": "ap-south-1",
        "AWS_ACCESS_KEY_ID": "K",
        "AWS_SECRET_ACCESS_KEY": "S",
    }
    opts = S3Options.from_uri("s3://bucket-x", env=env)
    assert (opts.endpoint, opts.region, opts.access_key_id, opts.prefix) == ("http://e:2", "ap-south-1", "K", "")
    for bad in (
        "s3://ab",
        "s3://Bucket",
        "s3://b-1/x?part_size=1MiB",
        "s3://b-1/x?nope=1",
        "s3://user:pw@bucket/x",
        "s3://b-1/../x",
        "s3://b-1?retries=x",
        "s3://b-1?allow_http=maybe",
        "s3://b-1?access_key_id=only",
    ):
        with pytest.raises(ConfigError):
            open_storage(bad)


def test_errors_name_tier_key_and_code(s3_storage, seaweed):
    from tiersave.errors import ObjectNotFoundError, PermissionDeniedError

    with pytest.raises(ObjectNotFoundError, match=r"reading 'nope/x' on s3://.*/root/prefix failed: HTTP 404"):
        s3_storage.get("nope/x")
    wrong = S3Storage.from_uri(seaweed.uri("no-such-bucket-here"), env={}, access_key_id="a", secret_access_key="b")
    with pytest.raises(PermissionDeniedError, match="HTTP 403"):
        wrong.get("x")
    missing = seaweed.storage("never-created-bucket", create_bucket=False)
    with pytest.raises(ObjectNotFoundError, match="bucket does not exist"):
        missing.list_dirs("")


def test_part_buffers_not_reused_while_obstore_still_sends_them(s3_storage):
    """obstore uploads parts zero-copy from the buffers it is handed: a buffer may be reused only once
    obstore released it. Many distinct parts through a small write buffer catch any early reuse."""
    part = s3_storage.options.part_bytes
    nparts = 10
    writer = s3_storage.open_writer("distinct.bin")
    for i in range(nparts):
        writer.write_at(i * part, memoryview(bytes([i + 1]) * part))
    writer.finish(nparts * part)
    data = s3_storage.get("distinct.bin")
    for i in range(nparts):
        chunk = data[i * part : (i + 1) * part]
        assert chunk.count(i + 1) == part, f"part {i} holds foreign bytes"


def test_without_obstore_an_s3_uri_names_the_extra():
    """The package checks for obstore before any of its modules imports it, so a missing extra is a
    BackendUnavailableError naming tiersave[s3], not a bare ImportError from whichever module came first."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["obstore"] = None  # what an environment without the extra looks like to an import
        from tiersave.errors import BackendUnavailableError
        from tiersave.storage import open_storage
        try:
            open_storage("s3://bucket-x/run")
        except BackendUnavailableError as exc:
            print(f"raised: {exc}")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "raised: the s3:// tier needs obstore: pip install 'tiersave[s3]'"


def test_conditional_replace_names_the_version_it_replaces(s3_storage):
    """put_if_version is S3's If-Match PUT: it replaces the version read, and nothing else."""
    from tiersave.errors import ConfigError, PreconditionFailedError
    from tiersave.storage.base import ConditionalUpdate

    assert isinstance(s3_storage, ConditionalUpdate)
    s3_storage.put("lease.json", b"first")
    first = s3_storage.get_version("lease.json")
    assert first.data == b"first" and first.version and first.mtime > 0
    s3_storage.put_if_version("lease.json", b"second", first.version)
    second = s3_storage.get_version("lease.json")
    assert second.data == b"second" and second.version != first.version
    # another writer replaced the version read: refused, and the other writer's bytes stay
    with pytest.raises(PreconditionFailedError, match="no longer the version read"):
        s3_storage.put_if_version("lease.json", b"stale writer", first.version)
    assert s3_storage.get("lease.json") == b"second"
    s3_storage.delete("lease.json")
    with pytest.raises(PreconditionFailedError):  # deleted meanwhile: not created again
        s3_storage.put_if_version("lease.json", b"stale writer", second.version)
    assert not s3_storage.exists("lease.json")
    with pytest.raises(ConfigError, match="no version"):
        s3_storage.put_if_version("lease.json", b"x", "")
