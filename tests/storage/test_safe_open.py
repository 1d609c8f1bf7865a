"""Every open under a root is safe: no link followed at any depth, regular files only, nothing blocks.

Real special files on the real file systems (ext4 under pytest's tmp_path, tmpfs under /dev/shm): a FIFO
in place of a shard or a manifest, a linked directory component, a step directory that links outside
the root. Each operation runs on a watchdog thread, so a regression that blocks fails the test within
seconds (the watchdog opens the FIFO's other end to release the stuck thread) instead of hanging CI.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.errors import CheckpointNotFoundError, FormatError, ObjectNotFoundError, StorageError
from tiersave.storage import open_storage
from tiersave.storage.posix import LocalStorage

STEP_DIR = "step-0000000001"
SHARD = "shard-00000-000.bin"
LIMIT_S = 10.0


def bounded(
    fn: Callable[[], Any], fifos: list[Path] = (), limit_s: float = LIMIT_S
) -> tuple[Any, BaseException | None]:  # type: ignore[assignment]
    """Run ``fn`` on a thread; fail the test if it has not returned within ``limit_s`` seconds."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # the test inspects it
            out["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        for fifo in fifos:  # a reader blocked in open() on the FIFO returns once a writer opens it
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(5)
        pytest.fail(f"blocked for over {limit_s} s (a FIFO was opened before its type was checked)")
    assert time.monotonic() - start < limit_s
    return out.get("value"), out.get("error")


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private memory-tier base on the real /dev/shm (tmpfs)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    base = Path(tempfile.mkdtemp(prefix="tiersave-test-", dir="/dev/shm"))
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["local", "mem"])
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    """A real checkpoint of step 1, on local disk or in the memory tier: (uri, root directory)."""
    if request.param == "local":
        uri = str(tmp_path / "ckpt")
    else:
        request.getfixturevalue("shm_dir")
        uri = "mem://safe-open"
    with tiersave.Checkpointer(uri) as ckpt:
        ckpt.save(1, {"w": torch.arange(4096, dtype=torch.float32), "n": 3})
    storage = open_storage(uri, create=False)
    return uri, Path(storage.root)  # type: ignore[attr-defined]


def make_fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


# -- special files ------------------------------------------------------------------------------------


def test_fifo_shard_fails_restore_and_verify_quickly(saved: tuple[str, Path]) -> None:
    uri, root = saved
    fifo = make_fifo(root / STEP_DIR / SHARD)
    with tiersave.Checkpointer(uri) as ckpt:
        _, error = bounded(lambda: ckpt.restore(1), [fifo])
        assert isinstance(error, FormatError), error
        assert f"{STEP_DIR}/{SHARD}' is a FIFO (named pipe), not a regular file" in str(error)
        report, error = bounded(lambda: ckpt.verify(1), [fifo])
    assert error is None and not report.ok
    assert "is a FIFO (named pipe)" in report.errors[0]


def test_fifo_manifest_fails_verify_quickly_and_is_not_listed(saved: tuple[str, Path]) -> None:
    uri, root = saved
    fifo = make_fifo(root / STEP_DIR / "manifest.json")
    with tiersave.Checkpointer(uri) as ckpt:
        report, error = bounded(lambda: ckpt.verify(1), [fifo])
        assert error is None and not report.ok and "is a FIFO" in report.errors[0]
        steps, error = bounded(lambda: ckpt.list(), [fifo])
        assert error is None and steps == []


def test_fifo_in_direct_mode_reader_never_blocks(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "s", io="direct")
    fifo = storage.root / "f"
    os.mkfifo(fifo)
    _, error = bounded(lambda: storage.open_reader("f"), [fifo])
    assert isinstance(error, FormatError) and "FIFO" in str(error)
    _, error = bounded(lambda: storage.get("f"), [fifo])
    assert isinstance(error, FormatError)
    assert not storage.exists("f") and [i.key for i in storage.list("")] == []


def test_a_directory_in_place_of_an_object_is_not_found(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    (tmp_path / "d").mkdir()
    with pytest.raises(ObjectNotFoundError, match="is a directory"):
        storage.open_reader("d")


# -- linked directories -------------------------------------------------------------------------------


def test_a_linked_directory_component_is_never_followed(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    outside = tmp_path / "outside" / "b"
    outside.mkdir(parents=True)
    (outside / "secret.bin").write_bytes(b"outside the root")
    (storage.root / "a").mkdir()
    (storage.root / "a" / "b").symlink_to(outside)
    key = "a/b/secret.bin"
    for read in (lambda: storage.get(key), lambda: storage.open_reader(key)):
        with pytest.raises(FormatError, match="directory 'a/b' is a symbolic link; tiersave never follows links"):
            read()
    assert not storage.exists(key)
    with pytest.raises(ObjectNotFoundError, match="behind a symbolic link"):
        storage.head(key)
    assert [i.key for i in storage.list("")] == [] and list(storage.list("a/b")) == []
    assert storage.list_dirs("a") == [] and storage.list_dirs("a/b") == []
    # writes refuse it too, and nothing appears outside the root
    with pytest.raises(FormatError):
        storage.put("a/b/new.bin", b"x")
    with pytest.raises(FormatError):
        storage.open_writer("a/b/new.bin")
    with pytest.raises(FormatError):
        storage.delete_prefix("a/b/secret.bin")
    assert sorted(p.name for p in outside.iterdir()) == ["secret.bin"]
    storage.delete_prefix("a")  # removes the link itself, never what it points to
    assert (outside / "secret.bin").read_bytes() == b"outside the root"


def test_a_shard_behind_a_linked_step_directory_is_not_read(saved: tuple[str, Path], tmp_path: Path) -> None:
    # The step directory stays; its shard's directory component is swapped for a link to a valid copy
    # elsewhere: a restore that followed it would read bytes from outside the root.
    uri, root = saved
    outside = tmp_path / "elsewhere"
    shutil.copytree(root / STEP_DIR, outside)
    nested = root / STEP_DIR / "sub"
    nested.symlink_to(outside)
    storage = open_storage(uri, create=False)
    with pytest.raises(FormatError, match=f"directory '{STEP_DIR}/sub' is a symbolic link"):
        storage.open_reader(f"{STEP_DIR}/sub/{SHARD}")


def test_a_step_directory_linking_outside_the_root_is_refused_everywhere(
    saved: tuple[str, Path], tmp_path: Path
) -> None:
    uri, root = saved
    outside = tmp_path / "outside-step"
    shutil.move(str(root / STEP_DIR), outside)  # a valid checkpoint, now outside the root
    (root / STEP_DIR).symlink_to(outside)
    with tiersave.Checkpointer(uri) as ckpt:
        assert ckpt.list() == []
        with pytest.raises(CheckpointNotFoundError):
            ckpt.restore(1)
        report, error = bounded(lambda: ckpt.verify(1))
    assert error is None and not report.ok and report.bytes_checked == 0
    assert f"directory '{STEP_DIR}' is a symbolic link" in report.errors[0]
    catalog = Catalog(open_storage(uri, create=False))
    assert catalog.steps() == []
    assert not catalog.verify(1).ok
    assert outside.joinpath("manifest.json").is_file()  # untouched


def test_a_replaced_root_is_refused(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    storage.put("x", b"1")
    (tmp_path / "root").rename(tmp_path / "moved")
    (tmp_path / "other").mkdir()
    (tmp_path / "root").symlink_to(tmp_path / "other")
    with pytest.raises(StorageError, match="no longer a directory"):
        storage.get("x")
    (tmp_path / "root").unlink()
    (tmp_path / "root").mkdir()
    with pytest.raises(StorageError, match="was replaced by another directory"):
        storage.put("y", b"2")
    assert not (tmp_path / "root" / "y").exists()
