"""``drain.copy_shards``, the copy of one node's part of a checkpoint (partdrain.py): the transfer of
``copy_checkpoint`` (every chunk checked against its CRC-32C) into a given attempt, with no commit, holding no more
chunk buffers than ``copy_checkpoint`` does (one per thread and one more), whatever the buffer budget."""

from __future__ import annotations

import pytest
import torch

import tiersave
from tiersave import drain
from tiersave.catalog import Catalog
from tiersave.drain import copy_shards, destination_names
from tiersave.engine.pool import DaemonThreadPool
from tiersave.errors import CorruptCheckpointError
from tiersave.knobs import override_env
from tiersave.storage.posix import LocalStorage


@pytest.fixture
def saved(tmp_path):
    """A committed checkpoint of 16 chunks of 64 KiB."""
    root = tmp_path / "src"
    with override_env("TIERSAVE_CHUNK_BYTES", 64 << 10), tiersave.Checkpointer(root, event_log=False) as ckpt:
        ckpt.save(3, {"w": torch.arange(16 * (16 << 10), dtype=torch.float32)}).result()
    return Catalog(LocalStorage(root, create=False))


def test_the_part_lands_byte_for_byte_with_a_bounded_number_of_buffers(saved, tmp_path, monkeypatch):
    made = []
    real = drain.aligned_buffer
    monkeypatch.setattr(drain, "aligned_buffer", lambda n: made.append(n) or real(n))
    dst = LocalStorage(tmp_path / "dst")
    manifest = saved.manifest(3)
    pool = DaemonThreadPool(2, "test-copy")
    try:
        written = copy_shards(saved, dst, manifest, "attempt", [0], executor=pool, io_threads=2, buffer_bytes=1 << 30)
    finally:
        pool.shutdown(wait=True)
    name = destination_names(manifest)[0]
    assert written == {name: manifest.shards[0].size}
    src_bytes = saved.storage.get(f"step-{3:010d}/{manifest.shards[0].file}", max_bytes=1 << 30)
    assert dst.get(f"attempt/{name}", max_bytes=1 << 30) == src_bytes
    assert len(made) == 3  # two threads and one more: not the 16 chunks the 1 GiB budget would allow


def test_a_corrupt_source_chunk_fails_and_leaves_nothing(saved, tmp_path):
    manifest = saved.manifest(3)
    path = saved.storage.root / f"step-{3:010d}" / manifest.shards[0].file
    data = bytearray(path.read_bytes())
    data[100_000] ^= 0xFF
    path.write_bytes(bytes(data))
    dst = LocalStorage(tmp_path / "dst")
    pool = DaemonThreadPool(2, "test-copy")
    try:
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            copy_shards(saved, dst, manifest, "attempt", [0], executor=pool, io_threads=2)
    finally:
        pool.shutdown(wait=True)
    assert [i.key for i in dst.list("attempt")] == []


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_the_derived_attempt_name_is_the_prefix_begin_gives(tmp_path, kind, request):
    """What rank 0 removes after failing before it began the attempt is where the other nodes wrote."""
    from types import SimpleNamespace

    from tiersave.commit import commit_for
    from tiersave.partdrain import PartDrains

    storage = LocalStorage(tmp_path / "t") if kind == "local" else request.getfixturevalue("s3_storage")
    token = "4242-0badf00d-00000000feedface"
    tier = SimpleNamespace(storage=storage, commit=commit_for(storage), name="t")
    drains = SimpleNamespace(_token=lambda tier, step: token)
    assert PartDrains.attempt(drains, tier, 7) == tier.commit.begin(7, token)  # type: ignore[arg-type]
