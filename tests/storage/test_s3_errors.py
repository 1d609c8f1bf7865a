"""An operator's S3 mistakes (no credentials, wrong ones, no endpoint, nothing listening) are errors that say
where the request went and with what: the endpoint, the bucket, and which ``AWS_*`` settings were found,
by name only, never a secret value. Against the real SeaweedFS server the other S3 tests start."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from helpers import within
from tiersave.errors import PermissionDeniedError, StorageError
from tiersave.storage import open_storage
from tiersave.testing.seaweed import SeaweedServer

SECRET = "s3cr3t-value-never-printed"
KEY_ID = "AKIAEXAMPLEKEYID0000"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    return monkeypatch


def failure(uri: str, limit_s: float = 60.0) -> StorageError:
    """The error of a first write through ``open_storage(uri)``, which must come within ``limit_s``."""
    with pytest.raises(StorageError) as info:
        within(limit_s, lambda: open_storage(uri).put("probe", b"x"))
    return info.value


def test_no_credentials_names_endpoint_bucket_and_settings(seaweed: SeaweedServer, clean_env: Any) -> None:
    error = failure(seaweed.uri("ts-nocreds", "p", retries="0"))
    msg = str(error)
    assert isinstance(error, PermissionDeniedError)
    assert "HTTP 403" in msg  # no longer alone:
    assert f"endpoint {seaweed.endpoint} (from the URI's endpoint option)" in msg
    assert "bucket 'ts-nocreds'" in msg
    assert "no credentials (no access_key_id/secret_access_key option, AWS_ACCESS_KEY_ID and" in msg
    assert "AWS_* variables set: none" in msg


def test_wrong_credentials_name_the_variables_never_their_values(seaweed: SeaweedServer, clean_env: Any) -> None:
    clean_env.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    clean_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    clean_env.setenv("AWS_SESSION_TOKEN", SECRET + "-token")
    clean_env.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
    clean_env.setenv("AWS_PROFILE", "dev")
    error = failure("s3://ts-wrongcreds/p?retries=0")
    msg = str(error)
    assert isinstance(error, PermissionDeniedError)
    assert f"endpoint {seaweed.endpoint} (from AWS_ENDPOINT_URL)" in msg and "bucket 'ts-wrongcreds'" in msg
    assert "static credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY with a session token" in msg
    assert (
        "AWS_* variables set: AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, AWS_PROFILE, AWS_SECRET_ACCESS_KEY, "
        "AWS_SESSION_TOKEN" in msg
    )
    assert SECRET not in msg and KEY_ID not in msg and SECRET not in repr(error.args)


def test_credentials_in_the_uri_are_named_not_shown(seaweed: SeaweedServer, clean_env: Any) -> None:
    uri = seaweed.uri("ts-uricreds", "p", retries="0", access_key_id=KEY_ID, secret_access_key=SECRET)
    msg = str(failure(uri))
    assert "static credentials from the URI's access_key_id/secret_access_key options" in msg
    assert SECRET not in msg and KEY_ID not in msg


def test_no_endpoint_says_requests_went_to_aws(clean_env: Any) -> None:
    # Where the network allows it AWS answers 403; offline it is a connection error: both say where they went.
    msg = str(failure("s3://ts-noendpoint/p?retries=0&timeout=5s&connect_timeout=2s"))
    assert "no endpoint set, so AWS's https://s3.us-east-1.amazonaws.com" in msg
    assert "bucket 'ts-noendpoint'" in msg and "AWS_ENDPOINT_URL" in msg


def test_nothing_listening_names_the_endpoint(clean_env: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    endpoint = f"http://127.0.0.1:{port}"
    msg = str(failure(f"s3://ts-closed/p?endpoint={endpoint}&retries=0&timeout=5s&connect_timeout=2s"))
    assert f"endpoint {endpoint} (from the URI's endpoint option)" in msg and "bucket 'ts-closed'" in msg


def test_a_missing_key_stays_a_plain_not_found(s3_storage: Any) -> None:
    with pytest.raises(FileNotFoundError) as info:
        s3_storage.get("missing")
    assert "endpoint" not in str(info.value)  # the normal flow carries no setup diagnosis
