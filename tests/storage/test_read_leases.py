"""Read leases between real processes, on a local root, ``mem://`` and the real SeaweedFS S3 server.

A writer process saves as fast as it can with ``keep_last=1`` while this process exports, verifies, restores and
copies named steps with reads slowed down (a throttled storage wrapper, fault injection only): every read
completes whole and right though the writer's retention wants the step gone long before the read ends, and the
step is deleted once the read is over. A reader killed with SIGKILL, or stopped with SIGSTOP (alive, no longer
renewing), pins its step only until its lease is judged dead or expired. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import tiersave
from tiersave.catalog import Catalog
from tiersave.drain import copy_checkpoint
from tiersave.errors import CheckpointNotFoundError
from tiersave.export import export_safetensors
from tiersave.storage import open_storage
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import FaultyStorage

SRC = str(Path(__file__).resolve().parents[2] / "src")
ELEMENTS = 16384  # 64 KiB of float32: 16 checksum chunks of 4 KiB, each read slowed down

_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch, tiersave
    root, ready, stop, out = sys.argv[1:5]
    ckpt = tiersave.Checkpointer(root, keep_last=1, chunk_bytes=4096, handle_sigterm=False, event_log=False)
    step, deadline = 0, time.monotonic() + 300
    while not os.path.exists(stop) and time.monotonic() < deadline:
        step += 1
        ckpt.save(step, {"w": torch.full((ELEMENTS,), float(step))})
        if step == 1:
            open(ready, "w").close()
        time.sleep(0.005)
    ckpt.close()
    with open(out, "w") as f:
        f.write(str(step))
    """
).replace("ELEMENTS", str(ELEMENTS))

_READER = textwrap.dedent(
    """
    import sys, time
    from tiersave.catalog import Catalog
    from tiersave.storage import open_storage
    root, step, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ckpt = Catalog(open_storage(root, create=False)).open(step)
    open(ready, "w").close()
    time.sleep(120)
    """
)


@pytest.fixture(params=["local", "mem", "s3"])
def tier(request, tmp_path, monkeypatch) -> Any:
    """``(uri, storage, env)``: a root on the tier, a storage on it in this process, the writer's environment."""
    # 3 s: a deletion pass must write its record and read the leases within half of it (a loaded machine's
    # fsync can take a second), and a stopped reader's lease must still expire within the test
    env = {"PYTHONPATH": SRC, "TIERSAVE_READ_LEASE_TTL_S": "3"}
    monkeypatch.setenv("TIERSAVE_READ_LEASE_TTL_S", "3")
    if request.param == "local":
        uri = str(tmp_path / "root")
        yield uri, LocalStorage(uri), env
    elif request.param == "mem":
        env["TIERSAVE_SHM_DIR"] = str(tmp_path / "shm")
        monkeypatch.setenv("TIERSAVE_SHM_DIR", env["TIERSAVE_SHM_DIR"])
        uri = f"mem://leases-{uuid.uuid4().hex[:8]}"
        yield uri, open_storage(uri), env
    else:
        seaweed = request.getfixturevalue("seaweed")
        bucket = request.getfixturevalue("s3_bucket")
        for key, value in seaweed.env().items():
            monkeypatch.setenv(key, value)
        env.update(seaweed.env())
        storage = seaweed.storage(bucket, "run")  # creates the bucket
        yield seaweed.uri(bucket, "run"), storage, env
        storage.close()


class Throttled(FaultyStorage):
    """The real storage with every chunk read slowed down, noting each read made while the checkpoint it reads
    was no longer committed (it "vanished mid-read"; on a file system the open shard would still read)."""

    def __init__(self, inner: Any, delay: float) -> None:
        super().__init__(inner, delays={"read_into": delay})
        self.vanished: list[str] = []

    def open_reader(self, key: str) -> Any:
        reader = super().open_reader(key)
        read_into, manifest = reader.read_into, f"{key.split('/', 1)[0]}/manifest.json"

        def checked(offset: int, out: memoryview) -> None:
            read_into(offset, out)
            if not self.inner.exists(manifest):
                self.vanished.append(key)

        reader.read_into = checked
        return reader


def _wait_for(path: Path, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what} did not start: {proc.communicate()[1].decode()[-3000:]}")
        time.sleep(0.02)


def _read(how: str, slow: Throttled, step: int, tmp_path: Path) -> None:
    """Read ``step`` whole through the throttled storage, and check that it holds what step ``step`` saved."""
    want = torch.full((ELEMENTS,), float(step))
    if how == "export":
        dest = tmp_path / f"export-{step}.safetensors"
        export_safetensors(Catalog(slow), step, dest, overwrite=True)
        assert torch.equal(load_file(dest)["w"], want)
    elif how == "verify":
        report = Catalog(slow).verify(step)
        gone = f"no checkpoint of step {step} in {slow.uri}"  # deleted before verify read its manifest
        if not report.ok and ("deleted before it could be read" in report.errors[0] or report.errors[0] == gone):
            raise CheckpointNotFoundError(report.errors[0])
        assert report.ok, report.errors
    elif how == "restore":
        with tiersave.Checkpointer(slow, event_log=False) as reader:
            assert torch.equal(reader.restore(step)["w"], want)
    else:
        dst = LocalStorage(tmp_path / f"copy-{uuid.uuid4().hex[:6]}")
        copy_checkpoint(slow, dst, step, io_threads=2)
        assert Catalog(dst).verify(step).ok


def test_named_step_reads_complete_while_a_fast_writer_with_keep_last_1_saves(tier, tmp_path, monkeypatch):
    uri, storage, env = tier
    monkeypatch.setenv("TIERSAVE_IO_THREADS", "2")
    ready, stop, out = tmp_path / "ready", tmp_path / "stop", tmp_path / "saves"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, uri, str(ready), str(stop), str(out)],
        env={**os.environ, **env},
        stderr=subprocess.PIPE,
    )
    outcomes: Counter[str] = Counter()
    overtaken = 0
    try:
        _wait_for(ready, writer, "the writer")
        catalog = Catalog(storage)
        delay = 0.1 if uri.startswith("s3://") else 0.03  # a read spans several saves (slower on S3)
        slow = Throttled(storage, delay)
        hows = ["export", "verify", "restore", "copy"]
        for attempt in range(48):  # at least 12; more while a loaded machine loses races to the writer's deletes
            reads = sum(n for k, n in outcomes.items() if k != "gone before the read")
            if attempt >= 12 and reads >= 8 and overtaken >= 4:
                break
            how = hows[attempt % len(hows)]
            step = catalog.steps()[-1]  # the newest: the writer's retention deletes it at its next save
            try:
                _read(how, slow, step, tmp_path)
            except CheckpointNotFoundError:  # deleted before its lease was written: a clear error, allowed
                outcomes["gone before the read"] += 1
                continue
            outcomes[how] += 1
            newest = catalog.steps()[-1]
            overtaken += newest >= step + 2  # two saves later: keep_last=1 would have deleted it mid-read
            deadline = time.monotonic() + 60  # the lease is dropped: the step goes at the writer's next save
            while step in catalog.steps():
                assert time.monotonic() < deadline, f"step {step} was not deleted after its read ended"
                time.sleep(0.02)
    finally:
        stop.touch()
        try:
            writer.wait(timeout=120)
        finally:
            if writer.poll() is None:
                writer.kill()
    assert writer.returncode == 0, writer.stderr.read().decode()[-3000:] if writer.stderr else ""
    saves = int(out.read_text())
    reads = sum(n for k, n in outcomes.items() if k != "gone before the read")
    print(
        f"\n{uri.split(':')[0] if '://' in uri else 'local'}: {reads} named-step reads ({dict(outcomes)}) during "
        f"{saves} writer saves with keep_last=1, {overtaken} overtaken by 2+ saves mid-read, "
        f"{len(slow.vanished)} chunk reads of a vanished checkpoint"
    )
    assert reads >= 8 and overtaken >= 4, (outcomes, overtaken)
    assert slow.vanished == []
    assert Catalog(storage).leases.leased() == {}


@pytest.mark.parametrize("signal_", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_dead_or_stopped_readers_lease_stops_holding_its_step(tier, tmp_path, signal_):
    uri, _, env = tier
    ready = tmp_path / "reader-ready"
    with tiersave.Checkpointer(uri, keep_last=1, event_log=False) as writer:
        writer.save(1, {"w": torch.ones(8)})
        reader = subprocess.Popen(
            [sys.executable, "-c", _READER, uri, "1", str(ready)], env={**os.environ, **env}, stderr=subprocess.PIPE
        )
        try:
            _wait_for(ready, reader, "the reader")
            writer.save(2, {"w": torch.ones(8)})
            assert writer.catalog.steps() == [1, 2]  # leased by the reader: kept
            reader.send_signal(signal_)
            if signal_ == signal.SIGSTOP:  # alive but renewing no more: held until its time to live passes
                writer.save(3, {"w": torch.ones(8)})
                assert writer.catalog.steps() == [1, 3]
                time.sleep(3 + 1.5)
            else:
                reader.wait(timeout=30)
            writer.save(4, {"w": torch.ones(8)})
            assert writer.catalog.steps() == [4]
            assert writer.catalog.leases.leased() == {}
        finally:
            reader.kill()
            if signal_ == signal.SIGSTOP:
                reader.send_signal(signal.SIGCONT)
            reader.wait(timeout=30)


_EXEC = textwrap.dedent(
    """
    import os, sys, time
    root, step, started, go = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    open(started, "w").write(str(step))
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(0 if os.path.exists(os.path.join(root, "step-%010d" % step, "manifest.json")) else 3)
    """
)


def test_watch_exec_holds_a_lease_on_the_checkpoint_while_the_command_runs(tmp_path):
    root, started, go, script = tmp_path / "root", tmp_path / "started", tmp_path / "go", tmp_path / "cmd.py"
    script.write_text(_EXEC)
    with tiersave.Checkpointer(root, keep_last=1, event_log=False) as writer:
        writer.save(1, {"w": torch.ones(8)})
        command = f"{sys.executable} {script} {root} {{step}} {started} {go}"
        watcher = subprocess.Popen(
            [sys.executable, "-m", "tiersave.cli", "watch", str(root), "--all", "--count", "1", "--exec", command],
            env={**os.environ, "PYTHONPATH": SRC},
            stderr=subprocess.PIPE,
        )
        try:
            _wait_for(started, watcher, "the --exec command")
            for step in (2, 3, 4):  # keep_last=1: step 1 would be gone at once
                writer.save(step, {"w": torch.ones(8)})
            assert writer.catalog.steps() == [1, 4]
            go.touch()
            assert watcher.wait(timeout=60) == 0, watcher.stderr.read().decode()[-2000:] if watcher.stderr else ""
        finally:
            go.touch()
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait(timeout=30)
        writer.save(5, {"w": torch.ones(8)})  # the command ended, and with it the lease
        assert writer.catalog.steps() == [5]


def test_a_watch_loop_body_holds_the_checkpoint_it_was_given(tmp_path):
    root = tmp_path / "root"
    with tiersave.Checkpointer(root, keep_last=1, event_log=False) as writer:
        writer.save(1, {"w": torch.ones(8)})
        feed = tiersave.watch(root, include_existing=True, poll_s=0.02, timeout_s=30)
        info = next(feed)
        writer.save(2, {"w": torch.ones(8)})
        writer.save(3, {"w": torch.ones(8)})
        assert writer.catalog.steps() == [1, 3]  # the loop body still handles step 1
        assert next(feed).step == 3  # the next turn of the loop releases it
        writer.save(4, {"w": torch.ones(8)})
        assert info.step not in writer.catalog.steps()
        feed.close()  # type: ignore[attr-defined]
        writer.save(5, {"w": torch.ones(8)})
        assert writer.catalog.steps() == [5]


def test_a_dcp_load_holds_a_read_lease_that_another_process_retention_respects(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from tiersave.dcp import Reader, Writer

    root = tmp_path / "root"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns on every call that it runs without a process group
        dcp.save({"w": torch.arange(4096, dtype=torch.float32)}, storage_writer=Writer(root, step=1))
        dcp.save({"w": torch.zeros(4096)}, storage_writer=Writer(root, step=2))
        pruned: list[list[int]] = []

        class PruneOnFirstRead(FaultyStorage):
            def open_reader(self, key: str) -> Any:
                if not pruned:  # another process's retention (keep 1) runs while the load reads step 1
                    pruned.append(Catalog(LocalStorage(root)).prune(keep_last=1).deleted)
                return super().open_reader(key)

        out = {"w": torch.empty(4096)}
        dcp.load(out, storage_reader=Reader(PruneOnFirstRead(LocalStorage(root)), step=1))
    assert torch.equal(out["w"], torch.arange(4096, dtype=torch.float32))
    assert pruned == [[]]  # step 1 was kept while it was read
    assert Catalog(LocalStorage(root)).prune(keep_last=1).deleted == [1]
