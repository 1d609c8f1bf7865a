"""Copy committed checkpoints between tiers: local -> s3 -> mem -> local bit-exact, corrupt sources
detected while copying, and a destination that is never committed when anything fails."""

from __future__ import annotations

import itertools
import uuid

import pytest
import torch

import tiersave
from helpers import assert_same
from tiersave.catalog import Catalog
from tiersave.commit import MarkerCommit
from tiersave.drain import copy_checkpoint, copy_checkpoints, same_checkpoint
from tiersave.errors import AlreadyExistsError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from tiersave.format.layout import step_dirname
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage
from tiersave.testing.faults import Fault, FaultyStorage


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "big": torch.randn(1024, 1100, generator=g),  # 4.3 MiB: several 1 MiB chunks, unaligned tail
            "bf16": torch.randn(333, 7, generator=g).to(torch.bfloat16),
            "int": torch.arange(5, dtype=torch.int64),
            "empty": torch.empty(0, 3),
        },
        "opt": {"lr": 0.1, "moments": [torch.randn(700, 300, generator=g)]},
        "step": step,
    }


@pytest.fixture
def local_ckpts(tmp_path):
    """A local root with steps 10 and 20, 1 MiB chunks, two shards per checkpoint."""
    root = tmp_path / "src"
    with tiersave.Checkpointer(root, chunk_bytes=1 << 20, max_shard_bytes=5 << 20) as ckpt:
        for step in (10, 20):
            ckpt.save(step, state_for(step), metrics={"loss": 1.0 / step}, tags=["milestone"]).result()
    return LocalStorage(root)


@pytest.fixture
def mem():
    storage = MemoryStorage(f"copy-{uuid.uuid4().hex[:12]}")
    yield storage
    storage.destroy()


def _restore(storage, step):
    with tiersave.Checkpointer(storage) as ckpt:  # commit protocol chosen by the storage's capabilities
        return ckpt.restore(step)


@pytest.mark.s3
def test_round_trip_local_s3_mem_local_bit_exact(local_ckpts, s3_storage, mem, tmp_path):
    back = LocalStorage(tmp_path / "back")
    seen = []
    r1 = copy_checkpoint(local_ckpts, s3_storage, 20, read_back=True, progress=lambda d, t: seen.append((d, t)))
    assert r1.read_back and not r1.skipped and r1.tensor_bytes > 4 << 20
    assert seen[-1][0] == seen[-1][1] and all(a <= b for (a, _), (b, _) in itertools.pairwise(seen))
    r2 = copy_checkpoint(s3_storage, mem, 20)
    r3 = copy_checkpoint(mem, back, 20)
    assert r3.destination.endswith(step_dirname(20))
    # object-store layout: shards under the attempt prefix, manifest at the step
    s3_manifest = Catalog(s3_storage).manifest(20)
    assert all(s.file.startswith("attempt-") and s.file.count("/") == 1 for s in s3_manifest.shards)
    assert len(s3_manifest.shards) == 2
    for storage in (s3_storage, mem, back):
        report = Catalog(storage).verify(20)
        assert report.ok, report.errors
        assert same_checkpoint(Catalog(storage).manifest(20), Catalog(local_ckpts).manifest(20))
    # bit-exact shard bytes and a bit-exact restore from every tier
    src_m = Catalog(local_ckpts).manifest(20)
    for shard_a, shard_b in zip(src_m.shards, Catalog(back).manifest(20).shards):
        a = local_ckpts.get(f"{step_dirname(20)}/{shard_a.file}")
        b = back.get(f"{step_dirname(20)}/{shard_b.file}")
        assert a == b
    for storage in (s3_storage, mem, back):
        assert_same(_restore(storage, 20), state_for(20))
    assert r2.tensor_bytes == r1.tensor_bytes == r3.tensor_bytes


def test_copy_all_skips_identical_and_refuses_different(local_ckpts, mem, tmp_path):
    results = copy_checkpoints(local_ckpts, mem)
    assert [r.step for r in results] == [10, 20] and not any(r.skipped for r in results)
    again = copy_checkpoints(local_ckpts, mem)
    assert all(r.skipped and r.tensor_bytes == 0 for r in again)
    with pytest.raises(AlreadyExistsError, match="same checkpoint"):
        copy_checkpoint(local_ckpts, mem, 10)
    # a different checkpoint of step 10 elsewhere: never overwrites, even with skip
    other_root = tmp_path / "other"
    with tiersave.Checkpointer(other_root) as ckpt:
        ckpt.save(10, state_for(11)).result()
    with pytest.raises(AlreadyExistsError, match="different checkpoint"):
        copy_checkpoint(LocalStorage(other_root), mem, 10, if_exists="skip")
    assert_same(_restore(mem, 10), state_for(10))
    with pytest.raises(CheckpointNotFoundError):
        copy_checkpoint(local_ckpts, mem, 999)


def _corrupt_one_byte(storage: LocalStorage, step: int, at: int = 1 << 20) -> None:
    m = Catalog(storage).manifest(step)
    path = storage.path(f"{step_dirname(step)}/{m.shards[0].file}")
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.s3
def test_corrupt_source_detected_nothing_committed_on_s3(local_ckpts, s3_storage):
    _corrupt_one_byte(local_ckpts, 20)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        copy_checkpoint(local_ckpts, s3_storage, 20)
    assert info.value.step == 20 and info.value.tensor
    assert Catalog(s3_storage).steps() == []
    assert list(s3_storage.list("")) == []
    assert s3_storage.list_multipart_uploads("") == []
    copy_checkpoint(local_ckpts, s3_storage, 10)  # the intact checkpoint still copies
    assert Catalog(s3_storage).steps() == [10]


def test_corrupt_source_detected_nothing_committed_locally(local_ckpts, tmp_path):
    _corrupt_one_byte(local_ckpts, 10, at=(2 << 20) + 17)
    dst = LocalStorage(tmp_path / "dst")
    with pytest.raises(CorruptCheckpointError):
        copy_checkpoint(local_ckpts, dst, 10, io_threads=3, buffer_bytes=1)
    assert Catalog(dst).steps() == [] and list(dst.list("")) == [] and dst.list_dirs("") == []


@pytest.mark.parametrize("op", ["open_writer", "write_at", "finish", "put"])
def test_destination_failure_leaves_nothing(local_ckpts, tmp_path, op):
    dst = FaultyStorage(LocalStorage(tmp_path / "dst"), [Fault(op, nth=2 if op == "write_at" else 1)])
    with pytest.raises(StorageError):
        copy_checkpoint(local_ckpts, dst, 20)
    assert Catalog(dst.inner).steps() == [] and list(dst.inner.list("")) == [] and dst.inner.list_dirs("") == []
    dst.faults.clear()
    copy_checkpoint(local_ckpts, dst, 20)
    assert Catalog(dst.inner).verify(20).ok


class _BitRotStorage(FaultyStorage):
    """Stores one flipped bit in the first chunk it writes (a device that corrupts data at rest)."""

    def open_writer(self, key, *, size_hint=None):
        inner = self.inner.open_writer(key, size_hint=size_hint)
        owner = self

        class Writer:
            def __init__(self):
                self.key = inner.key

            def write_at(self, offset, data):
                if not owner.ops["rot"]:
                    owner.ops["rot"] += 1
                    data = bytearray(data)
                    data[len(data) // 2] ^= 1
                    data = memoryview(data)
                inner.write_at(offset, data)

            def finish(self, size):
                inner.finish(size)

            def abort(self):
                inner.abort()

        return Writer()


def test_read_back_catches_destination_corruption(local_ckpts, mem):
    dst = _BitRotStorage(mem)
    with pytest.raises(CorruptCheckpointError, match="read back"):
        copy_checkpoint(local_ckpts, dst, 10, read_back=True)
    assert Catalog(mem).steps() == [] and mem.list_dirs("") == []


@pytest.mark.s3
def test_racing_copies_one_commit_no_overwrite(local_ckpts, s3_storage, tmp_path):
    """Two copies of different checkpoints of step 10 race on one bucket: one commits, the other gets
    AlreadyExistsError; the committed one is intact and nothing of the loser remains after cleanup."""
    import threading

    other_root = tmp_path / "other"
    with tiersave.Checkpointer(other_root, chunk_bytes=1 << 20) as ckpt:
        ckpt.save(10, state_for(11)).result()
    sources = {"a": local_ckpts, "b": LocalStorage(other_root)}
    barrier = threading.Barrier(2)
    outcome = {}

    def run(name):
        barrier.wait()
        try:
            copy_checkpoint(sources[name], s3_storage, 10)
            outcome[name] = "committed"
        except AlreadyExistsError:
            outcome[name] = "lost"

    threads = [threading.Thread(target=run, args=(n,)) for n in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcome.values()) == ["committed", "lost"], outcome
    winner = next(n for n, o in outcome.items() if o == "committed")
    assert same_checkpoint(Catalog(s3_storage).manifest(10), Catalog(sources[winner]).manifest(10))
    assert Catalog(s3_storage).verify(10).ok
    assert MarkerCommit(s3_storage).leftovers() == []
    assert s3_storage.list_multipart_uploads("") == []
