"""Which steps are committed, read while a writer commits a newer step and deletes the older one."""

from __future__ import annotations

import builtins

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.storage import open_storage


class _StaleOnce:
    """A real storage whose first root listing is the one a reader took just before a writer committed
    step 2 and deleted step 1 (fault injection; everything else is the real storage)."""

    def __init__(self, storage: object, stale: builtins.list[str]) -> None:
        self._storage, self._stale, self.listings = storage, stale, 0

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        self.listings += 1
        if self.listings == 1 and prefix == "":
            return list(self._stale)
        return self._storage.list_dirs(prefix)  # type: ignore[attr-defined,no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._storage, name)


@pytest.mark.parametrize("where", ["local", "mem"])
def test_a_listing_that_missed_the_commit_of_the_step_replacing_a_deleted_one_is_taken_again(
    tmp_path, monkeypatch, where
):
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(tmp_path / "shm"))  # the memory tier's files go with the test
    uri = str(tmp_path / "root") if where == "local" else "mem://listing-race"
    with tiersave.Checkpointer(uri, keep_last=1, event_log=False) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
        ckpt.save(2, {"w": torch.ones(4) * 2})  # commits step 2, then deletes step 1
    storage = _StaleOnce(open_storage(uri), ["step-0000000001"])
    assert Catalog(storage).steps() == [2]  # type: ignore[arg-type]
    assert storage.listings == 2


def test_a_newer_directory_without_a_manifest_costs_one_more_listing_not_a_loop(tmp_path):
    root = tmp_path / "root"
    with tiersave.Checkpointer(str(root), event_log=False) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
    (root / "step-0000000009").mkdir()  # damaged or made by hand: never a checkpoint
    storage = _StaleOnce(open_storage(str(root)), ["step-0000000001", "step-0000000009"])
    assert Catalog(storage).steps() == [1]  # type: ignore[arg-type]
    assert storage.listings == 2
