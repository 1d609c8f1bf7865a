"""Directories another user can change are refused: the memory tier's base (per user, private, as ssh
treats key files) and a local root owned by someone else that group or others can write.

Ownership by another user is made for real with ``os.chown`` (needs root; skipped cleanly otherwise)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiersave.errors import ConfigError
from tiersave.storage import open_storage
from tiersave.storage.memory import MemoryStorage, shm_base
from tiersave.storage.posix import LocalStorage

OTHER_UID = 54321  # no such user here: "owned by uid 54321"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user needs root")


@pytest.fixture
def shm_parent() -> Iterator[Path]:
    """A scratch directory on the real /dev/shm; the tests point TIERSAVE_SHM_DIR inside it."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = Path(tempfile.mkdtemp(prefix="tiersave-trust-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_memory_tier_base_is_per_user_and_private(monkeypatch: pytest.MonkeyPatch, shm_parent: Path) -> None:
    monkeypatch.delenv("TIERSAVE_SHM_DIR", raising=False)
    assert shm_base() == Path(f"/dev/shm/tiersave-{os.geteuid()}")
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(shm_parent / "base"))
    storage = MemoryStorage("run")
    st = os.stat(shm_parent / "base")
    assert st.st_uid == os.geteuid() and st.st_mode & 0o077 == 0
    storage.put("k", b"v")
    assert storage.get("k") == b"v"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_memory_tier_base_writable_by_others_is_refused(
    monkeypatch: pytest.MonkeyPatch, shm_parent: Path, mode: int
) -> None:
    base = shm_parent / "base"
    base.mkdir()
    base.chmod(mode)
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(base))
    with pytest.raises(ConfigError) as info:
        open_storage("mem://run")
    msg = str(info.value)
    assert f"the memory-tier directory {base} is writable by" in msg and f"(mode {mode:04o})" in msg
    assert "another user could delete or replace checkpoints" in msg and "TIERSAVE_SHM_DIR" in msg
    assert not (base / "run").exists()  # refused before anything was created under it


@needs_root
def test_memory_tier_base_owned_by_another_user_is_refused(monkeypatch: pytest.MonkeyPatch, shm_parent: Path) -> None:
    base = shm_parent / "base"
    base.mkdir(mode=0o700)
    os.chown(base, OTHER_UID, -1)
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(base))
    with pytest.raises(ConfigError, match=rf"owned by uid {OTHER_UID}, not by you \(uid 0"):
        MemoryStorage("run")
    with pytest.raises(ConfigError):
        MemoryStorage("run", create=False)  # reading from it is refused as well


def test_memory_tier_base_that_is_a_link_is_refused(monkeypatch: pytest.MonkeyPatch, shm_parent: Path) -> None:
    (shm_parent / "real").mkdir(mode=0o700)
    (shm_parent / "base").symlink_to(shm_parent / "real")
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(shm_parent / "base"))
    with pytest.raises(ConfigError, match="is a symbolic link; refusing to use it"):
        MemoryStorage("run")


@needs_root
@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_local_root_of_another_user_writable_by_others_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    monkeypatch.delenv("TIERSAVE_ALLOW_SHARED_ROOT", raising=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, OTHER_UID, -1)
    shared.chmod(mode)
    with pytest.raises(ConfigError) as info:
        LocalStorage(shared)
    msg = str(info.value)
    assert f"checkpoint root {shared} is owned by uid {OTHER_UID} and writable by" in msg
    assert "TIERSAVE_ALLOW_SHARED_ROOT=1" in msg
    monkeypatch.setenv("TIERSAVE_ALLOW_SHARED_ROOT", "1")  # a team directory shared on purpose
    LocalStorage(shared).put("k", b"v")


@needs_root
def test_local_roots_that_are_yours_or_not_writable_by_others_are_accepted(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    own.chmod(0o777)  # yours: yours to share
    LocalStorage(own).put("k", b"v")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, -1)
    theirs.chmod(0o755)  # another user's, but nobody else can write it
    LocalStorage(theirs)


def test_pytest_temporary_directories_are_accepted(tmp_path: Path) -> None:
    LocalStorage(tmp_path).put("k", b"v")
    LocalStorage(tmp_path / "new" / "root").put("k", b"v")
