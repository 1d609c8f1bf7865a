"""Abandoned temporary directories of another host on a shared file system: as on an object store, this host
cannot ask whether that writer lives, so its directory is kept until nothing was written to it for the grace
(``TIERSAVE_LEFTOVER_GRACE_S``), then the retention after a commit removes it. A part drain's attempt whose rank 0
died carries that rank 0's host: a later job's rank 0 on another host cleans it this way."""

from __future__ import annotations

import os
import time

import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.format.layout import tmp_dirname
from tiersave.knobs import override_env
from tiersave.storage.posix import LocalStorage

FOREIGN = "4242-0badf00d-00000000feedface"  # pid 4242 on a host id that is not this one's


def test_another_hosts_directory_survives_the_grace_then_goes_with_the_next_commit(tmp_path):
    root = tmp_path / "shared"
    abandoned = root / tmp_dirname(7, FOREIGN)
    abandoned.mkdir(parents=True)
    (abandoned / "shard-00000-000.bin").write_bytes(b"\0" * 4096)
    (abandoned / "part-node-00001.json").write_bytes(b"{}")
    just_begun = root / tmp_dirname(9, FOREIGN.replace("feedface", "0000beef"))
    just_begun.mkdir()  # nothing written yet: it could be a save that has just begun
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with tiersave.Checkpointer(root, keep_last=2, event_log=False) as ckpt:
        ckpt.save(1, state).result()  # default grace (a day): a writer elsewhere may still be at work
        statuses = dict(Catalog(LocalStorage(root, create=False)).leftovers())
        assert statuses == {abandoned.name: "unknown", just_begun.name: "unknown"}
        old = time.time() - 60
        for f in abandoned.iterdir():
            os.utime(f, (old, old))
        with override_env("TIERSAVE_LEFTOVER_GRACE_S", 30):
            ckpt.save(2, state).result()
        assert ckpt.wait(60)  # the leftovers the commit found are removed off the commit thread (reclaim.py)
        assert not abandoned.exists()
        assert just_begun.exists()  # empty: kept whatever its age
        assert [i.step for i in ckpt.list()] == [1, 2]
        assert torch.equal(ckpt.restore(2)["w"], state["w"])
