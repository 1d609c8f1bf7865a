"""Incremental drains (``Tier(..., incremental=True)``, docs/tiers.md "Incremental tiers"): a chain memory ->
local (incremental) -> S3 (incremental, zstd) on the real SeaweedFS server writes on each later tier only the
shards that changed, every kept step of every tier restores bit for bit, retention keeps referenced steps, a
corrupt referenced shard is found in every step using it, and a copy of such a step is self-contained."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from contextlib import redirect_stdout

import pytest
import torch

import tiersave
from helpers import assert_same
from tiersave.autocompress import AutoCompress
from tiersave.catalog import Catalog
from tiersave.cli import main as cli_main
from tiersave.drain import CopyResult, copy_checkpoint
from tiersave.drain_refs import ShardRefs
from tiersave.errors import ConfigError, CorruptCheckpointError
from tiersave.format.layout import MANIFEST_NAME, step_dirname
from tiersave.storage import open_storage
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage

FROZEN = 3 << 20  # fp32 elements per frozen tensor: 12 MiB, a shard of its own in an incremental save


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    frozen = {f"base{i}": torch.randn(FROZEN, generator=g) for i in range(2)}  # the same bytes at every step
    return {**frozen, "adapter": torch.full((4096,), float(step)), "step": step}


def tier_bytes(storage, step: int) -> int:
    """Bytes of the shard files under ``step``'s directory on a tier: what its drain wrote there."""
    prefix = step_dirname(step)
    return sum(o.size for o in storage.list(prefix) if not o.key.endswith(MANIFEST_NAME))


def restore(storage, step: int) -> dict:
    with tiersave.Checkpointer(storage) as ckpt:
        return ckpt.restore(step)


def run_chain(first, later, steps, **options):
    first = first if first.name else dataclasses.replace(first, name="first")
    with tiersave.Checkpointer(tiers=[first, *later], incremental=True, **options) as ckpt:
        for step in steps:
            ckpt.save(step, state(step)).result()
            assert ckpt.wait(120)


def test_chain_memory_local_s3_writes_only_what_changed(tmp_path, s3_storage):
    mem = MemoryStorage(f"tierinc-{uuid.uuid4().hex[:8]}")
    local = LocalStorage(tmp_path / "local")
    steps = list(range(1, 7))
    try:
        run_chain(
            tiersave.Tier(mem, keep=2),
            [
                tiersave.Tier(local, name="local", incremental=True, full_every=4, keep=2),
                tiersave.Tier(s3_storage, name="s3", incremental=True, compress="zstd", keep=1),
            ],
            steps,
        )
        for storage in (local, s3_storage):
            catalog = Catalog(storage)
            kept = catalog.steps()
            first = tier_bytes(storage, 1) if 1 in kept else None
            for step in kept:
                m = catalog.manifest(step)
                assert m.referenced_steps <= set(kept), (storage.uri, step)  # retention kept what is referenced
                written = tier_bytes(storage, step)
                assert written == sum(s.stored_size for s in m.shards if not s.is_reference)
                if m.referenced_steps:
                    full = sum(s.stored_size for s in m.shards)
                    assert written <= 0.10 * full, (storage.uri, step, written, full)
                if first is not None and step > 1 and m.referenced_steps:
                    assert written <= 0.10 * first
                assert_same(restore(storage, step), state(step))
                assert catalog.verify(step).ok
            assert Catalog(storage).manifest(kept[-1]).referenced_steps, storage.uri  # the newest is incremental
        # full_every=4 on the local tier: steps 1 and 5 are full drains, 2-4 and 6 reference the one before
        local_steps = Catalog(local).steps()
        assert Catalog(local).manifest(6).referenced_steps == {5}
        assert local_steps == [5, 6]
        s3 = Catalog(s3_storage)
        assert all(s.encoding is not None for s in s3.manifest(6).shards)  # compressed shards, referenced
        for step in Catalog(mem).steps():
            assert_same(restore(mem, step), state(step))
    finally:
        shutil.rmtree(mem.root, ignore_errors=True)


def test_later_memory_tier_keeps_referenced_steps(tmp_path):
    """Retention on an incremental mem:// tier (keep=1) keeps the step the kept one references."""
    mem = MemoryStorage(f"tierinc-{uuid.uuid4().hex[:8]}")
    try:
        run_chain(tiersave.Tier(tmp_path / "first"), [tiersave.Tier(mem, incremental=True, keep=1)], [1, 2, 3])
        catalog = Catalog(mem)
        assert catalog.steps() == [1, 3]  # 2 went; 1 holds the frozen shards 3 references
        assert catalog.manifest(3).referenced_steps == {1}
        for step in (1, 3):
            assert_same(restore(mem, step), state(step))
    finally:
        shutil.rmtree(mem.root, ignore_errors=True)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_corrupt_referenced_shard_is_found_in_every_step_using_it(tmp_path, s3_storage, where):
    later = LocalStorage(tmp_path / "later") if where == "local" else s3_storage
    compress = "zstd" if where == "s3" else None
    run_chain(tiersave.Tier(tmp_path / "first"), [tiersave.Tier(later, incremental=True, compress=compress)], [1, 2, 3])
    catalog = Catalog(later)
    m3 = catalog.manifest(3)
    ref = next(s for s in m3.shards if s.is_reference)
    key = ref.key(step_dirname(3))
    data = bytearray(later.get(key))
    data[len(data) // 2] ^= 0x10
    if where == "local":
        path = tmp_path / "later" / key
        path.chmod(0o644)
        path.write_bytes(bytes(data))
    else:
        later.put(key, bytes(data), mode="overwrite")
    users = [s for s in catalog.steps() if s == ref.step or ref.step in catalog.manifest(s).referenced_steps]
    assert users == [1, 2, 3]
    for step in users:
        report = Catalog(later).verify(step)
        assert not report.ok, step
        assert ref.file.rsplit("/", 1)[-1] in " ".join(report.errors), (step, report.errors)


def test_inspect_shows_bytes_referenced_on_a_drained_tier(tmp_path):
    later = tmp_path / "later"
    run_chain(tiersave.Tier(tmp_path / "first"), [tiersave.Tier(later, incremental=True)], [1, 2])
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["inspect", str(later), "--step", "2"]) == 0
    line = next(x for x in out.getvalue().splitlines() if "incremental:" in x)
    assert "24.00 MiB referenced (held by step 1)" in line, line


def test_copy_of_an_incremental_tier_step_is_self_contained(tmp_path):
    later = LocalStorage(tmp_path / "later")
    run_chain(tiersave.Tier(tmp_path / "first"), [tiersave.Tier(later, incremental=True)], [1, 2])
    dst = LocalStorage(tmp_path / "copy")
    copy_checkpoint(later, dst, 2, read_back=True)
    assert not Catalog(dst).manifest(2).referenced_steps
    assert_same(restore(dst, 2), state(2))


def test_a_source_without_content_hashes_drains_full_with_a_reason(tmp_path, caplog):
    later = LocalStorage(tmp_path / "later")
    caplog.set_level(logging.WARNING, logger="tiersave.drain_refs")
    with tiersave.Checkpointer(
        tiers=[tiersave.Tier(tmp_path / "a", name="a"), tiersave.Tier(later, incremental=True)]
    ) as c:
        for step in (1, 2, 3):
            c.save(step, state(step)).result()
            assert c.wait(60)
    assert all(not Catalog(later).manifest(s).referenced_steps for s in (1, 2, 3))
    reasons = [r.getMessage() for r in caplog.records if "no content hashes" in r.getMessage()]
    assert len(reasons) == 1 and "incremental=True" in reasons[0]
    assert_same(restore(later, 3), state(3))


def test_each_checkpointer_says_once_that_its_source_has_no_content_hashes(tmp_path, caplog):
    """The reason is given once per tier of a Checkpointer, not once per process: a second Checkpointer draining
    to the same tier says it again (its user may not have seen the first one's log)."""
    later = LocalStorage(tmp_path / "later")
    caplog.set_level(logging.WARNING, logger="tiersave.drain_refs")
    small = {"w": torch.arange(4096, dtype=torch.float32)}
    for run in (1, 2):
        tiers = [tiersave.Tier(tmp_path / "a", name="a"), tiersave.Tier(later, incremental=True)]
        with tiersave.Checkpointer(tiers=tiers) as c:
            for step in (10 * run + 1, 10 * run + 2):
                c.save(step, small).result()
                assert c.wait(60)
        reasons = [r.getMessage() for r in caplog.records if "no content hashes" in r.getMessage()]
        assert len(reasons) == run, reasons


def test_bad_options_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="incremental must be True or False"):
        tiersave.Tier(tmp_path, incremental="yes")
    with pytest.raises(ConfigError, match="full_every applies to incremental"):
        tiersave.Tier(tmp_path, full_every=3)
    with pytest.raises(ConfigError, match="full_every must be a positive integer"):
        tiersave.Tier(tmp_path, incremental=True, full_every=0)
    with pytest.raises(ConfigError, match="incremental= applies to later tiers"):
        tiersave.Checkpointer(tiers=[tiersave.Tier(tmp_path / "a", incremental=True), tiersave.Tier(tmp_path / "b")])


def test_open_storage_of_a_later_tier_reads_references(tmp_path):
    """A reader that knows nothing of the chain (a plain root opened by URI) resolves the references."""
    run_chain(tiersave.Tier(tmp_path / "first"), [tiersave.Tier(tmp_path / "later", incremental=True)], [1, 2])
    storage = open_storage(str(tmp_path / "later"))
    assert Catalog(storage).manifest(2).referenced_steps == {1}
    assert_same(restore(storage, 2), state(2))


SAVER = """
import sys, torch, tiersave
FROZEN = 3 << 20
def state(step):
    g = torch.Generator().manual_seed(0)
    frozen = {f"base{i}": torch.randn(FROZEN, generator=g) for i in range(2)}
    return {**frozen, "adapter": torch.full((4096,), float(step)), "step": step}
mem, local = sys.argv[1], sys.argv[2]
tiers = [tiersave.Tier(mem, name="mem"), tiersave.Tier(local, name="local", incremental=True, full_every=3, keep=3)]
with tiersave.Checkpointer(tiers=tiers, incremental=True) as ckpt:
    for step in range(1, 9):
        ckpt.save(step, state(step)).result()
        print("saved", step, flush=True)
    ckpt.wait(60)
print("done", flush=True)
import time; time.sleep(600)  # a timed kill must find it alive, however fast the machine finished the saves
"""


@pytest.mark.parametrize(
    "kill", ["after_shard_fsync:5", "after_manifest:6", "after_rename:7", "timer:0.1", "timer:0.4"]
)
def test_kill_during_incremental_drain_leaves_every_committed_step_restorable(tmp_path, kill):
    """SIGKILL at a crash point of a commit (the first tier's and the drains' commits count alike, so some
    land in an incremental drain) or at a random instant: every step committed on the incremental tier restores
    bit for bit, and a new run drains incrementally on top of them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    point, _, value = kill.partition(":")
    if point != "timer":
        env["TIERSAVE_CRASHPOINT"] = kill
    mem = MemoryStorage(f"tierinc-{uuid.uuid4().hex[:8]}")
    local = tmp_path / "local"
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, f"mem://{mem.name}", str(local)], stdout=subprocess.PIPE, env=env
        )
        try:
            assert proc.stdout is not None
            if point == "timer":
                assert proc.stdout.readline().startswith(b"saved")  # the first save is in; drains are running
                time.sleep(float(value))
                proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert proc.returncode == -signal.SIGKILL, out
        catalog = Catalog(LocalStorage(local))
        for step in catalog.steps():
            assert catalog.manifest(step).referenced_steps <= set(catalog.steps())
            assert_same(restore(LocalStorage(local), step), state(step))
        tiers = [tiersave.Tier(mem, name="mem"), tiersave.Tier(local, name="local", incremental=True, keep=3)]
        with tiersave.Checkpointer(tiers=tiers, incremental=True) as ckpt:
            ckpt.save(20, state(20)).result()
            assert ckpt.wait(60)
        assert_same(restore(LocalStorage(local), 20), state(20))
    finally:
        shutil.rmtree(mem.root, ignore_errors=True)


def test_a_reference_missing_on_the_tier_fails_the_drain_before_its_commit(tmp_path):
    first, later = LocalStorage(tmp_path / "first"), LocalStorage(tmp_path / "later")
    with tiersave.Checkpointer(first, incremental=True) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state(step)).result()
    source = Catalog(first)
    copy_checkpoint(first, later, 1, refs=ShardRefs(later, source.manifest(1), None))
    base = Catalog(later).manifest(1)
    plan = ShardRefs(later, source.manifest(2), base)
    assert len(plan.refs) == 2 and plan.referenced_bytes == 2 * FROZEN * 4  # the two frozen shards
    gone = next(iter(plan.refs.values()))
    path = tmp_path / "later" / gone.key(step_dirname(2))
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"step 2: the drain to .* references .* not committed there"):
        copy_checkpoint(first, later, 2, refs=plan)
    assert Catalog(later).steps() == [1]
    assert not [p for p in (tmp_path / "later").iterdir() if ".tmp-" in p.name]  # the attempt was removed


def test_auto_compressed_incremental_tier(tmp_path):
    """compress="auto" with incremental=True: a drain that references every shard writes nothing and does not
    skew the tier's measured throughput; every step restores."""
    later = LocalStorage(tmp_path / "later")
    steps = [1, 2, 3]
    with tiersave.Checkpointer(
        tiers=[
            tiersave.Tier(tmp_path / "first", name="first"),
            tiersave.Tier(later, incremental=True, compress="auto"),
        ],
        incremental=True,
    ) as ckpt:
        frozen = {k: v for k, v in state(1).items() if k.startswith("base")}
        for step in steps:
            ckpt.save(step, frozen).result()
            assert ckpt.wait(60)
    for step in steps:
        assert_same(restore(later, step), frozen)
    m = Catalog(later).manifest(3)
    assert all(s.is_reference for s in m.shards) and m.referenced_steps == {1}
    # a drain that wrote nothing teaches the choice nothing (else the tier would measure 0 B/s)
    auto = AutoCompress("t", 2)
    nothing = CopyResult(3, "a", "b", 0, 0, 0.01, file_bytes=0)
    assert auto.drain(lambda compress: nothing) is nothing and auto.write_bps is None
