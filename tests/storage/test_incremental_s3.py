"""Incremental saves on the object-store tier (the real SeaweedFS server): references resolve through the
attempt prefixes of earlier steps, and retention keeps the steps a kept checkpoint references."""

from __future__ import annotations

import torch

import tiersave
from tiersave.catalog import Catalog


def test_incremental_saves_on_s3(s3_storage):
    g = torch.Generator().manual_seed(1)
    state = {"base": torch.randn(3 << 20, generator=g), "adapter": torch.zeros(1000)}
    saved = {}
    with tiersave.Checkpointer(s3_storage, incremental=True, full_every=3, keep_last=1) as ckpt:
        for step in range(1, 5):
            state["adapter"] += 1
            ckpt.save(step, state).result()
            saved[step] = {k: v.clone() for k, v in state.items()}
            if step == 3:
                # 2 went; 1 holds the base weights that 3 references (its shard under 1's attempt prefix)
                assert [i.step for i in ckpt.list()] == [1, 3]
                assert Catalog(s3_storage).manifest(3).referenced_steps == {1}
                for s in (1, 3):
                    restored = ckpt.restore(s)
                    assert all(torch.equal(restored[k], v) for k, v in saved[s].items())
                    assert ckpt.verify(s).ok
        # 4 is a full save (full_every=3): nothing references 1 any more
        assert [i.step for i in ckpt.list()] == [4]
        restored = ckpt.restore(4)
        assert all(torch.equal(restored[k], v) for k, v in saved[4].items())
