"""Replicated state written once (real multi-process jobs, gloo on 127.0.0.1): a model and optimizer identical
on every rank, declared ``replicated``, are stored once in total, split across the ranks; every rank restores
them, and the file tools (verify, export, ls, copy) and drains to a later tier read the checkpoint; a
declaration that does not hold fails every rank's save with an error naming the key and the ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import worker_env
import torch
from safetensors.torch import load_file

import tiersave
from tiersave.catalog import Catalog
from tiersave.cli import main as cli_main
from tiersave.format.layout import MANIFEST_NAME, step_dirname
from tiersave.storage.posix import LocalStorage

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "replicated_workers.py"
TIMEOUT = 8.0


def env(root: Path, **extra: str) -> dict[str, str]:
    return worker_env(root, TIMEOUT, **extra)


def manifest(root: Path, step: int) -> dict:
    return json.loads((root / step_dirname(step) / MANIFEST_NAME).read_bytes())


def replicated_names() -> set[str]:
    """The tensors of the workers' model and Adam state, as flattened (``model.0.weight``, ``optim.state.0.exp_avg``)."""
    import sys

    sys.path.insert(0, str(HERE))
    from replicated_workers import ddp_state

    from tiersave.replicated import select
    from tiersave.state import flatten

    state = ddp_state(0, 1)
    return {t.name for t in select(state, flatten(state), ["model", "optim"]).tensors}


@pytest.mark.parametrize("world", [2, 3])
def test_replicated_state_is_written_once_split_across_ranks_and_restored_by_every_rank(launch, tmp_path, world):
    root, second = tmp_path / "ckpt", tmp_path / "second"
    job = launch("replicated_save_restore", world, env=env(root, TIERSAVE_TEST_SECOND=str(second)), script=SCRIPT)
    names = replicated_names()
    for r in range(world):
        rec = job.rank(r)
        assert "crash" not in rec, rec
        assert rec["restored_latest"] and rec["restored_1"]
    doc = manifest(root, 2)
    tensors = doc["tensors"]
    # once in total: every replicated tensor under replicated/, none under any rank
    assert {n for n in tensors if n.startswith("replicated/")} == {f"replicated/{n}" for n in names}
    assert {n for n in tensors if n.startswith("rank-")} == {f"rank-{r:05d}/w" for r in range(world)}
    # the manifest records which rank's shard holds each one, and the bytes are split across the ranks
    by_rank = [0] * world
    for name, entry in tensors.items():
        if name.startswith("replicated/"):
            by_rank[doc["shards"][entry["shard"]]["rank"]] += entry["nbytes"]
    total = sum(by_rank)
    largest = max(e["nbytes"] for n, e in tensors.items() if n.startswith("replicated/"))
    assert all(b > 0 for b in by_rank), by_rank
    assert max(by_rank) <= total / world + largest, by_rank
    for r in range(world):  # what each rank reported writing: its own tensor and its share
        assert job.rank(r)["written_bytes"][1] == by_rank[r] + 1024 * 4
    # every rank read all of the replicated state and its own tensor
    assert {job.rank(r)["bytes_read"] for r in range(world)} == {total + 1024 * 4}
    # every rank's tree refers to the one copy
    for r in range(world):
        assert json.dumps(doc["tree"][f"rank-{r:05d}"]["model"]).count('"replicated/') > 0
    # the file tools and a drained copy read it like any other checkpoint
    assert cli_main(["verify", str(root), "--all"]) == 0
    assert cli_main(["verify", str(second), "--all"]) == 0
    assert Catalog(LocalStorage(second)).steps() == [1, 2]
    assert cli_main(["ls", str(root)]) == 0
    copy = tmp_path / "copy"
    assert cli_main(["copy", str(root), str(copy), "--all"]) == 0
    out = tmp_path / "model.safetensors"
    assert cli_main(["export", str(copy), "--prefix", "replicated/model.", "--to", str(out)]) == 0
    exported = load_file(str(out))
    assert set(exported) == {n.removeprefix("model.") for n in names if n.startswith("model.")}
    with tiersave.Checkpointer(copy) as ckpt:  # one rank's full state, in a single process
        one = ckpt.restore(rank=world - 1)
        assert torch.equal(one["w"], torch.full((1024,), float((world - 1) * 1000 + 2)))
        assert torch.equal(one["model"]["0.weight"], exported["0.weight"])


def test_a_replicated_declaration_that_does_not_hold_fails_every_rank_naming_the_key_and_rank(launch, tmp_path):
    root = tmp_path / "ckpt"
    job = launch("replicated_mismatch", 3, env=env(root), script=SCRIPT)
    for r in range(3):
        rec = job.rank(r)
        assert "crash" not in rec, rec
        failure = rec["save1"]
        assert failure["type"] == "ConfigError", failure
        assert "'model' differs on rank(s) [1] from rank 0" in failure["message"]
        assert "'optim'" not in failure["message"]
        assert failure["elapsed"] < TIMEOUT  # an exchange of fingerprints, not a timeout
        assert rec["latest_after_failure"] is None  # nothing was written
        assert rec["latest"] == 2  # and the group stays usable: a declaration that holds saves
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]
    assert cli_main(["verify", str(root), "--all"]) == 0


def test_an_async_first_save_checks_the_declaration_in_the_background_and_fails_every_rank(launch, tmp_path):
    root = tmp_path / "ckpt"
    job = launch("replicated_async_mismatch", 2, env=env(root), script=SCRIPT)
    for r in range(2):
        rec = job.rank(r)
        assert "crash" not in rec, rec
        failure = rec["save1"]
        assert failure["type"] == "DistributedCheckpointError", failure
        assert "'model' differs on rank(s) [1] from rank 0" in failure["message"], failure
        assert "'optim'" not in failure["message"]
        assert failure["elapsed"] < TIMEOUT  # the vote's exchange, not a timeout
        assert rec["latest_after_failure"] is None  # nothing was committed
        assert rec["latest"] == 2
    # rank 0's save_async did not wait for rank 1, which started three seconds later
    assert job.rank(0)["blocked_s"] < 2.5, job.rank(0)
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]
    assert cli_main(["verify", str(root), "--all"]) == 0


def test_async_replicated_saves_reuse_the_layout_only_while_the_structure_holds_and_restore_exactly(launch, tmp_path):
    root = tmp_path / "ckpt"
    job = launch("replicated_reuse", 2, env=env(root), script=SCRIPT)
    for r in range(2):
        rec = job.rank(r)
        assert "crash" not in rec, rec
        assert rec["reused"] == [False, True, False, False, False, False, True], rec
        assert rec["exact"] == [True] * 7, rec
    assert cli_main(["verify", str(root), "--all"]) == 0


def test_a_rank_whose_state_lacks_a_declared_key_is_named_on_every_rank(launch, tmp_path):
    root = tmp_path / "ckpt"
    job = launch("replicated_missing_key", 2, env=env(root), script=SCRIPT)
    assert job.rank(1)["save1"]["type"] == "ConfigError"
    assert "['optim'] are not in the state" in job.rank(1)["save1"]["message"]
    failure = job.rank(0)["save1"]
    assert failure["type"] == "ConfigError" and "rank(s) [1] does not fit replicated=" in failure["message"]
    assert failure["elapsed"] < TIMEOUT


@pytest.mark.parametrize("nodes", [1, 2])
def test_ranks_sharing_a_machine_read_replicated_shards_buffered_and_alone_direct(launch, tmp_path, nodes):
    """Two ranks on one node read the replicated state's shards through the page cache (so the device serves
    those bytes about once for both), where a rank alone on its node keeps the direct reads of a direct root."""
    root = tmp_path / "ckpt"
    rank_env = {
        r: {"GROUP_RANK": str(r if nodes == 2 else 0), "LOCAL_RANK": str(0 if nodes == 2 else r)} for r in (0, 1)
    }
    job = launch("restore_io_paths", 2, env=env(root), script=SCRIPT, rank_env=rank_env)
    recs = [job.rank(r) for r in (0, 1)]
    for rec in recs:
        assert "crash" not in rec, rec
        assert rec["restored"], rec
    if any(rec["direct_refused"] for rec in recs):
        pytest.skip("this file system refuses O_DIRECT")
    total = 5 << 20  # four replicated 1 MiB tensors and the rank's own one
    for rec in recs:
        assert sum(rec["read"].values()) == total, rec["read"]
        if nodes == 1:
            assert rec["read"] == {"buffered": total}, rec["read"]
        else:
            assert "buffered" not in rec["read"], rec["read"]
