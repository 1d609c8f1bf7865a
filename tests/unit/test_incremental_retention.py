"""Retention of incremental checkpoints (docs/format.md section 9): a step kept because a kept checkpoint
references it keeps what it references in turn, and a deletion round deletes newest first, so one that stops
early (a kill, a step tagged since the plan) never leaves a listed checkpoint without its base.

The states have two tensors of 9 MiB, each in a shard of its own, changed one at a time: a shard unchanged for
one save and then changed gives step 3 a reference into step 2 and step 2 one into step 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.references import deletable
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage
from tiersave.tiers import Tier

N = (9 << 20) // 4  # float32 elements of 9 MiB: a shard of its own in an incremental save


def _every_listed_step_is_whole(catalog: Catalog) -> list[int]:
    steps = catalog.steps()
    for step in steps:
        report = catalog.verify(step)
        assert report.ok, (step, report.errors)
    return steps


def _chained(ckpt: tiersave.Checkpointer) -> dict[int, dict[str, torch.Tensor]]:
    """1 full; 2 changes y (references x in 1); 3 changes x (references y in 2); each drained before the next."""
    x, y = torch.zeros(N), torch.ones(N)
    saved = {}
    for step, change in ((1, None), (2, y), (3, x)):
        if change is not None:
            change += 1
        ckpt.save(step, {"x": x, "y": y})
        assert ckpt.wait(60)
        saved[step] = {"x": x.clone(), "y": y.clone()}
    return saved


@pytest.fixture(params=["local", "mem"])
def first_tier(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "root")
    else:
        name = f"test-{uuid.uuid4().hex[:12]}"
        yield f"mem://{name}"
        MemoryStorage(name).destroy()


def test_a_step_kept_for_its_references_keeps_what_it_references(first_tier):
    with tiersave.Checkpointer(first_tier, incremental=True, keep_last=1) as ckpt:
        saved = _chained(ckpt)
        assert sorted(ckpt.catalog.manifest(3).referenced_steps) == [2]
        assert sorted(ckpt.catalog.manifest(2).referenced_steps) == [1]
        assert _every_listed_step_is_whole(ckpt.catalog) == [1, 2, 3]  # step 1 used to be deleted
        for step in (2, 3):
            restored = ckpt.restore(step)
            assert torch.equal(restored["x"], saved[step]["x"]) and torch.equal(restored["y"], saved[step]["y"])
        ckpt.save(4, {"x": torch.full((N,), 7.0), "y": torch.full((N,), 8.0)})  # all new: references nothing
        ckpt.wait()
        assert ckpt.catalog.steps() == [4]  # nothing needs 1-3 any more: all deleted


def test_an_incremental_later_tier_keeps_the_chain_its_kept_step_needs(tmp_path):
    tiers = [Tier(tmp_path / "fast", keep=5), Tier(tmp_path / "slow", name="slow", keep=1, incremental=True)]
    with tiersave.Checkpointer(tiers=tiers, incremental=True) as ckpt:  # its saves hash what the drains compare
        _chained(ckpt)
        slow = ckpt._chain.tiers[1].catalog
        assert [sorted(slow.manifest(s).referenced_steps) for s in (2, 3)] == [[1], [2]]
        assert _every_listed_step_is_whole(slow) == [1, 2, 3]


def test_a_dry_run_reports_what_a_real_pass_deletes(tmp_path):
    with tiersave.Checkpointer(tmp_path / "root", incremental=True) as ckpt:
        _chained(ckpt)
        ckpt.save(4, {"x": torch.full((N,), 7.0), "y": torch.ones(N) + 1})  # references y in 2
        ckpt.wait()
        planned = ckpt.catalog.prune(keep_last=1, dry_run=True).deleted
        assert planned == [3]  # 2 stays for 4, and 1 for 2
        assert ckpt.prune(keep_last=1) == planned
        assert ckpt.catalog.steps() == [1, 2, 4]


_PRUNE_KILLED_AFTER_ONE_DELETION = textwrap.dedent(
    """
    import os, signal, sys
    import tiersave
    from tiersave.catalog import Catalog

    real = Catalog.delete

    def delete_then_die(self, step, reclaim=None):
        real(self, step, reclaim)
        print(step, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    Catalog.delete = delete_then_die
    with tiersave.Checkpointer(sys.argv[1], incremental=True) as ckpt:
        ckpt.prune(keep_last=1)
    """
)


def test_a_round_killed_between_two_deletions_leaves_every_listed_step_whole(tmp_path):
    root = tmp_path / "root"
    with tiersave.Checkpointer(root, incremental=True) as ckpt:
        x, y = torch.zeros(N), torch.ones(N)
        ckpt.save(1, {"x": x, "y": y})
        ckpt.save(2, {"x": x, "y": y + 1})  # references x in 1
        ckpt.save(3, {"x": x + 1, "y": y + 2})  # references nothing: 1 and 2 are doomed
        ckpt.wait()
    done = subprocess.run(
        [sys.executable, "-c", _PRUNE_KILLED_AFTER_ONE_DELETION, str(root)],
        env={**os.environ, "PYTHONPATH": str(Path(tiersave.__file__).parents[1])},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout.split() == ["2"]  # newest first: 2 went, and 1, which it referenced, stays whole
    assert _every_listed_step_is_whole(Catalog(LocalStorage(root))) == [1, 3]


def test_a_step_tagged_after_the_plan_keeps_its_base(tmp_path, monkeypatch):
    """Another process tags step 2 between the plan and the deletions (``tiersave tag``): step 2 stays, and so
    must step 1, which it references (it used to be deleted first)."""
    root = tmp_path / "root"
    with tiersave.Checkpointer(root, incremental=True) as ckpt:
        x, y = torch.zeros(N), torch.ones(N)
        ckpt.save(1, {"x": x, "y": y})
        ckpt.save(2, {"x": x, "y": y + 1})
        ckpt.save(3, {"x": x + 1, "y": y + 2})
        ckpt.wait()
        real = tiersave.catalog.unneeded

        def plan_then_tag(*args, **kwargs):
            out = real(*args, **kwargs)
            tagger = [sys.executable, "-m", "tiersave.cli", "tag", str(root), "2", "best"]
            subprocess.run(tagger, check=True, capture_output=True, timeout=120)
            return out

        monkeypatch.setattr(tiersave.catalog, "unneeded", plan_then_tag)
        assert ckpt.prune(keep_last=1) == []
        assert _every_listed_step_is_whole(ckpt.catalog) == [1, 2, 3]
        assert ckpt.catalog.tags.by_step().get(2) is not None


def test_deletable_marks_what_kept_steps_need_transitively_newest_first():
    def manifest(step: int, *refs: int) -> SimpleNamespace:
        return SimpleNamespace(step=step, referenced_steps=frozenset(refs))

    chain = [manifest(1), manifest(2, 1), manifest(3, 2), manifest(4), manifest(5, 4), manifest(6, 5)]
    # kept 5 and 6 need 4 (6 -> 5 -> 4); nothing kept needs 1-3; newest first
    assert deletable([1, 2, 3, 4], chain) == ([3, 2, 1], {1: frozenset(), 2: {1}, 3: {2}, 4: frozenset()})
    assert deletable([1, 2, 3, 4, 5], [*chain[:5], manifest(6)])[0] == [5, 4, 3, 2, 1]  # nothing kept needs them
    assert deletable([1, 2, 3], [*chain[:5], manifest(6, 3)])[0] == []  # 6 -> 3 -> 2 -> 1: the whole chain stays
    flat = [manifest(1), manifest(2, 1), manifest(3), manifest(4), manifest(5, 4), manifest(6)]
    assert deletable([1, 2, 4], flat)[0] == [2, 1]  # 4 stays for the kept 5; 2, and 1 with it, go


@pytest.mark.parametrize("where", ["first", "later"])
def test_a_chain_of_references_ends_in_a_full_save_without_full_every(tmp_path, where):
    """Tensors changed in turn make every save reference the one before, so keeping a step keeps the whole chain;
    without ``full_every`` disk use grew with every save. Once retention keeps more than
    MAX_KEPT_BY_REFERENCES steps for references alone, the next save (or drain) is full and the chain ends."""
    from tiersave.references import MAX_KEPT_BY_REFERENCES

    if where == "first":
        ckpt = tiersave.Checkpointer(tmp_path / "root", incremental=True, keep_last=2)
    else:
        tiers = [Tier(tmp_path / "fast", keep=2), Tier(tmp_path / "slow", name="slow", keep=2, incremental=True)]
        ckpt = tiersave.Checkpointer(tiers=tiers, incremental=True, full_every=1)  # the first tier: all full saves
    x, y = torch.zeros(N), torch.zeros(N)
    listed = []
    with ckpt:
        catalog = ckpt._chain.tiers[-1].catalog
        for step in range(1, 3 * MAX_KEPT_BY_REFERENCES):
            (x if step % 2 else y).add_(1)  # in turn: each save references the other tensor in the one before
            ckpt.save(step, {"x": x, "y": y})
            assert ckpt.wait(60)
            listed.append(len(catalog.steps()))
        # bounded after every save: kept, the chain, and the full saves that end it (retention's figure lags one)
        assert max(listed) <= 2 + MAX_KEPT_BY_REFERENCES + 2, listed
        steps = _every_listed_step_is_whole(catalog)
        full = [s for s in steps if s > 1 and not catalog.manifest(s).referenced_steps]
        assert full, steps  # a full save after the first ended the chain (and the older steps went)
        restored = ckpt.restore(steps[-1])
        assert torch.equal(restored["x"], x) and torch.equal(restored["y"], y)


@pytest.mark.parametrize(
    ("result", "want"),
    [({"kept_by_references": 9}, 9), ({"kept_by_references": 0}, 0), ({}, 0), (None, 0), ([9], 0)]
    + [({"kept_by_references": bad}, 0) for bad in (None, True, -1, 9.0, "9", [9])],
)
def test_the_figure_rank_0_announces_is_read_defensively(result, want):
    """A commit outcome from rank 0 without the figure (an older rank 0) or with a bad one bounds nothing."""
    from tiersave.saving import _announced

    assert _announced(result) == want
