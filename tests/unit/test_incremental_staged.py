"""Incremental saves that compare with the staging memory (docs/format.md section 9): a chunk whose new bytes
equal the previous save's still in the arena is found by ``memcmp`` and checked by its CRC-32C instead of
hashed; a changed chunk is hashed and written; a stale or corrupted arena is never referenced wrongly."""

from __future__ import annotations

import logging

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.engine import increment
from tiersave.storage import open_storage

MiB = 1 << 20


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of every unit the writer threads hash (``Increment.skip``), in order."""
    seen: list[int] = []
    real = increment.Increment.skip

    def skip(self, u, segments, view):  # type: ignore[no-untyped-def]
        seen.append(u.padded)
        return real(self, u, segments, view)

    monkeypatch.setattr(increment.Increment, "skip", skip)
    return seen


def referenced(root, step: int) -> int:
    return Catalog(open_storage(str(root))).manifest(step).referenced_bytes


@pytest.mark.parametrize("blocking", [False, True], ids=["bulk-staging", "overlapped-staging"])
def test_an_unchanged_tensor_is_compared_not_hashed_and_restores(root, hashed, blocking):
    base = torch.randn(4 * MiB)  # 16 MiB: 4 chunks of 4 MiB, a shard of its own
    lora = torch.zeros(1024)
    with tiersave.Checkpointer(root, incremental=True, chunk_bytes=4 * MiB) as ckpt:
        ckpt.save(1, {"base": base, "lora": lora}, blocking=blocking).result()
        assert sum(hashed) >= 16 * MiB  # the first save has nothing to compare with
        hashed.clear()
        lora += 1
        ckpt.save(2, {"base": base, "lora": lora}, blocking=blocking).result()
        assert sum(hashed) == 4096  # the adapter only: the base's 16 MiB were compared in the arena
        restored = ckpt.restore(2)
    assert referenced(root, 2) == 16 * MiB
    assert torch.equal(restored["base"], base) and torch.equal(restored["lora"], lora)


@pytest.mark.parametrize("blocking", [False, True], ids=["bulk-staging", "overlapped-staging"])
@pytest.mark.parametrize("where", [0, MiB // 4 - 1, 4 * MiB // 4 - 1], ids=["first", "end-of-a-mib", "last"])
def test_a_changed_chunk_inside_an_unchanged_tensor_is_written(root, hashed, blocking, where):
    w = torch.arange(4 * MiB, dtype=torch.float32)  # 16 MiB: 4 chunks of 4 MiB
    with tiersave.Checkpointer(root, incremental=True, chunk_bytes=4 * MiB) as ckpt:
        ckpt.save(1, {"w": w}, blocking=blocking).result()
        hashed.clear()
        w[MiB + where] = -7.0  # one float of the second chunk, at its start, inside or at its very end
        ckpt.save(2, {"w": w}, blocking=blocking).result()
        assert hashed == [4 * MiB]  # only the changed chunk is hashed; the other three compared equal
        restored = ckpt.restore(2)["w"]
        assert torch.equal(restored, w) and restored[MiB + where] == -7.0
        assert torch.equal(ckpt.restore(1)["w"], torch.arange(4 * MiB, dtype=torch.float32))
    assert referenced(root, 2) == 0  # a shard is referenced whole or written whole


def test_a_corrupted_arena_is_not_referenced(root, hashed, caplog):
    """Staging memory changed behind the record's back (a bug, a stray write): the new bytes equal the
    arena's, but not the base's. The CRC-32C check catches it; the chunk is hashed and written."""
    w = torch.randn(4 * MiB)
    with tiersave.Checkpointer(root, incremental=True, chunk_bytes=4 * MiB) as ckpt:
        ckpt.save(1, {"w": w}).result()
        arena = ckpt._saver.arena._tensor
        assert arena is not None
        changed = w.clone()
        changed[: MiB // 4] += 1.0  # the first MiB of the first chunk
        arena[: 16 * MiB].copy_(changed.view(torch.uint8))  # w sits at offset 0 of the save
        hashed.clear()
        with caplog.at_level(logging.WARNING, logger="tiersave.engine.increment"):
            ckpt.save(2, {"w": changed}).result()
        assert "no longer held the bytes its record says" in caplog.text
        assert 4 * MiB in hashed  # the corrupted chunk fell back to the hash
        assert torch.equal(ckpt.restore(2)["w"], changed)
        assert torch.equal(ckpt.restore(1)["w"], w)
    assert referenced(root, 2) == 0


def test_the_record_follows_the_last_save_staged(root, hashed):
    """What the arena holds is the last save's bytes, whatever its base: a save that changed every chunk
    becomes what the next one compares with, and the bytes of an older step are never taken for them."""
    w = torch.randn(4 * MiB)
    first = w.clone()
    with tiersave.Checkpointer(root, incremental=True, chunk_bytes=4 * MiB) as ckpt:
        ckpt.save(1, {"w": w}).result()
        w += 1.0
        hashed.clear()
        ckpt.save(2, {"w": w}).result()  # every chunk changed: hashed, written and recorded
        assert hashed == [4 * MiB] * 4
        hashed.clear()
        ckpt.save(3, {"w": w}).result()
        assert hashed == []  # step 2's bytes are still in the arena: all four chunks compared equal
        hashed.clear()
        ckpt.save(4, {"w": first}).result()  # back to step 1's bytes: they differ from the arena's, so hashed
        assert hashed == [4 * MiB] * 4
        assert torch.equal(ckpt.restore(3)["w"], w) and torch.equal(ckpt.restore(4)["w"], first)
    assert referenced(root, 2) == 0 and referenced(root, 3) == 16 * MiB and referenced(root, 4) == 0


@pytest.mark.parametrize("threads", [1, 3])
def test_copy_changed_copies_what_differs_and_says_which_copies_were_equal(threads):
    from tiersave.engine.stage import HostCopier

    copier = HostCopier(threads)
    try:
        src = [torch.randn(5 * MiB), torch.randn(5 * MiB), torch.randn(1024)]  # 20, 20 MiB and 4 KiB
        dst = [t.clone() for t in src]
        src[1][-1] += 1.0  # the very last byte range of the second copy differs
        src[2][0] += 1.0
        copies = [(d.data_ptr(), s.data_ptr(), s.nbytes) for d, s in zip(dst, src)]
        assert copier.copy_changed(copies) == [True, False, False]
        assert all(torch.equal(d, s) for d, s in zip(dst, src))
    finally:
        copier.close()
