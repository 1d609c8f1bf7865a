"""A checkpoint deleted by a writer's retention while another process verifies it is reported as gone, not as
damaged: a healthy checkpoint is never called corrupt."""

from __future__ import annotations

import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.storage.posix import LocalStorage


def test_a_checkpoint_deleted_while_verified_is_reported_gone_not_damaged(root):
    with tiersave.Checkpointer(root) as writer:
        writer.save(1, {"w": torch.arange(4096, dtype=torch.float32)})
        writer.save(2, {"w": torch.zeros(4096)})
    reader = Catalog(LocalStorage(root))
    reader.manifest(1)  # the reader has read the manifest (cached) when the writer's retention deletes the step
    Catalog(LocalStorage(root)).delete(1)
    report = reader.verify(1)
    assert not report.ok
    # found gone by the read lease's check, before any byte is read (docs/guarantees.md, "Read leases")
    assert report.errors == [f"no checkpoint of step 1 in {reader.storage.uri}: it was deleted before it could be read"]
    assert reader.verify(2).ok
