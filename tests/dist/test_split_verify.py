"""The checksums of the replicated state split among the ranks of one machine (real multi-process jobs, gloo on
127.0.0.1): each rank of a machine checks the replicated tensors written by its rank and reads the others'
unchecked, and the restore's agreement makes every rank fail when any share does not verify; a rank that dies
in that agreement makes the others fail within the timeout; ranks on different nodes check everything; ranks
that do not read the same files check what they read themselves."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import worker_env

from tiersave.catalog import Catalog
from tiersave.format.layout import step_dirname
from tiersave.format.manifest import Manifest
from tiersave.storage.posix import LocalStorage

pytestmark = pytest.mark.dist

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "split_verify_workers.py"
TIMEOUT = 8.0


def env(root: Path, **extra: str) -> dict[str, str]:
    return worker_env(root, TIMEOUT, **extra)


def on_nodes(nodes: int, world: int = 2) -> dict[int, dict[str, str]]:
    """Per-rank identities: all ranks on one node, or each rank on its own node."""
    return {
        r: {"GROUP_RANK": str(r if nodes > 1 else 0), "LOCAL_RANK": str(0 if nodes > 1 else r)} for r in range(world)
    }


def saved(launch, root: Path, nodes: int = 1) -> Manifest:
    job = launch("save", 2, env=env(root), script=SCRIPT, rank_env=on_nodes(nodes))
    for r in (0, 1):
        assert job.rank(r).get("saved"), job.logs
    return Catalog(LocalStorage(root)).manifest(1)


def replicated_bytes_by_writer(manifest: Manifest) -> dict[int, int]:
    out: dict[int, int] = {}
    for name, entry in manifest.tensors.items():
        if name.startswith("replicated/"):
            writer = manifest.shards[entry.shard].rank
            out[writer] = out.get(writer, 0) + entry.nbytes
    return out


def corrupt_share(root: Path, manifest: Manifest, writer: int) -> tuple[str, str]:
    """Flip one byte in chunk 2 of a large replicated tensor that rank ``writer`` wrote; its file and name."""
    for name, entry in sorted(manifest.tensors.items()):
        info = manifest.shards[entry.shard]
        if name.startswith("replicated/model.big") and info.rank == writer:
            path = root / step_dirname(1) / info.file
            with open(path, "r+b") as f:
                f.seek(entry.offset + 2 * (64 << 10) + 5)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0xFF]))
            return info.file, name
    raise AssertionError(f"rank {writer} wrote no large replicated tensor")


def test_two_ranks_on_one_machine_split_the_checks_and_restore_bit_exact(launch, tmp_path):
    root = tmp_path / "ckpt"
    manifest = saved(launch, root)
    by_writer = replicated_bytes_by_writer(manifest)
    assert set(by_writer) == {0, 1}, by_writer  # both ranks wrote a share
    job = launch("restore", 2, env=env(root), script=SCRIPT, rank_env=on_nodes(1))
    for r in (0, 1):
        rec = job.rank(r)
        assert "error" not in rec and "crash" not in rec, rec
        assert rec["exact"] and rec["exact_new"], rec
        # rank r checks what rank r wrote and leaves the other rank's share to it
        assert rec["unchecked_bytes"] == by_writer[1 - r], (rec, by_writer)
        assert rec["unchecked_bytes_new"] == by_writer[1 - r], (rec, by_writer)


@pytest.mark.parametrize("writer", [1, 0])
def test_a_corrupted_chunk_in_one_ranks_share_makes_both_ranks_raise_naming_it(launch, tmp_path, writer):
    root = tmp_path / "ckpt"
    manifest = saved(launch, root)
    file, tensor = corrupt_share(root, manifest, writer)
    job = launch("restore", 2, env=env(root), script=SCRIPT, rank_env=on_nodes(1))
    for r in (0, 1):
        rec = job.rank(r)
        assert "crash" not in rec, rec
        error = rec.get("error")
        assert error is not None, f"rank {r} restored a corrupted checkpoint: {rec}"
        assert error["type"] == "CorruptCheckpointError", error
        message = error["message"]
        assert file in message and tensor in message and "chunk 2" in message, message
        if r != writer:  # learnt from the checking rank through the agreement
            assert f"rank(s) {writer} could not use this copy" in message, message
        assert error["elapsed"] < TIMEOUT, error


def test_a_rank_dying_in_the_restore_agreement_makes_the_other_fail_within_its_timeout(launch, tmp_path):
    root = tmp_path / "ckpt"
    saved(launch, root)
    job = launch(
        "restore",
        2,
        env=env(root, TIERSAVE_TEST_DIE_IN_AGREEMENT="1"),
        script=SCRIPT,
        rank_env=on_nodes(1),
        deadline_s=60,
    )
    assert job.returncodes[1] not in (0, None), job.returncodes  # killed itself
    rec = job.rank(0)
    error = rec.get("error") or rec.get("crash")
    assert error is not None, f"rank 0 restored although rank 1 never reported its share: {rec}"
    assert error["type"] == "DistributedCheckpointError", error
    assert "rank 1 sent nothing" in error["message"], error
    assert error["failures"] == {"1": "TimeoutError"}, error
    assert TIMEOUT - 1 < error["elapsed"] < TIMEOUT + 15, error  # the coordination timeout, not a hang


def test_ranks_on_different_nodes_check_everything_they_read(launch_torchrun, launch, tmp_path):
    root = tmp_path / "ckpt"
    manifest = saved(launch, root, nodes=2)
    job = launch_torchrun("restore", 2, 1, env=env(root), script=SCRIPT)
    for r in (0, 1):
        rec = job.rank(r)
        assert "error" not in rec and "crash" not in rec, (rec, job.logs)
        assert rec["exact"] and rec["exact_new"], rec
        assert rec["unchecked_bytes"] == 0 and rec["unchecked_bytes_new"] == 0, rec
    # and a corrupted chunk in rank 0's share is found by rank 1's own check on the other node
    file, _ = corrupt_share(root, manifest, 0)
    job = launch_torchrun("restore", 2, 1, env=env(root), script=SCRIPT)
    for r in (0, 1):
        error = job.rank(r).get("error")
        assert error is not None and error["type"] == "CorruptCheckpointError", job.rank(r)
        assert file in error["message"] and "chunk 2" in error["message"], error
        assert "could not use this copy" not in error["message"], error  # its own check, not rank 0's word


def test_ranks_of_one_machine_reading_different_files_check_their_own_bytes(launch, tmp_path):
    """Rank 1 reads a copy of the root (other inodes) in which rank 0's share is corrupted, while rank 0
    checks its share in the intact original: rank 1 cannot rely on rank 0's check, checks the bytes it read
    itself, and both ranks fail naming the chunk."""
    root, copy = tmp_path / "ckpt", tmp_path / "copy"
    manifest = saved(launch, root)
    shutil.copytree(root, copy)
    file, _ = corrupt_share(copy, manifest, 0)
    job = launch("restore", 2, env=env(root, TIERSAVE_TEST_ROOT_1=str(copy)), script=SCRIPT, rank_env=on_nodes(1))
    for r in (0, 1):
        rec = job.rank(r)
        error = rec.get("error")
        assert error is not None and error["type"] == "CorruptCheckpointError", rec
        assert file in error["message"] and "chunk 2" in error["message"], error
    assert "rank(s) 1 could not use this copy" in job.rank(0)["error"]["message"]
    # and with an intact copy, both restore exactly, each checking what it read itself
    shutil.rmtree(copy)
    shutil.copytree(root, copy)
    job = launch("restore", 2, env=env(root, TIERSAVE_TEST_ROOT_1=str(copy)), script=SCRIPT, rank_env=on_nodes(1))
    for r in (0, 1):
        rec = job.rank(r)
        assert "error" not in rec and "crash" not in rec, rec
        assert rec["exact"] and rec["exact_new"], rec
        assert rec["unchecked_bytes"] == 0 and rec["unchecked_bytes_new"] == 0, rec


@pytest.mark.parametrize("split", ["1", "0"])
def test_a_load_failing_on_one_rank_makes_every_rank_raise_naming_it(launch, tmp_path, split):
    """Rank 1's live module has another shape for one buffer: its ``load_state_dict`` refuses the checkpoint
    when the state is loaded, which a split rank does only after the restore's agreement (``split="1"``) and a
    rank checking everything before it (``"0"``). Either way rank 1 raises its own ``StateMismatchError`` and
    rank 0 a ``DistributedCheckpointError`` naming rank 1, the step and the error, at once; neither restores,
    and the job can save afterwards."""
    root = tmp_path / "ckpt"
    saved(launch, root)
    extra = {"TIERSAVE_TEST_MISMATCH_RANK": "1", "TIERSAVE_SPLIT_VERIFY": split}
    job = launch("restore_mismatch", 2, env=env(root, **extra), script=SCRIPT, rank_env=on_nodes(1), deadline_s=90)
    own, other = job.rank(1), job.rank(0)
    assert "restored" not in own and "restored" not in other, (own, other)
    assert own["error"]["type"] == "StateMismatchError", own
    assert "mid1" in own["error"]["message"], own
    error = other["error"]
    assert error["type"] == "DistributedCheckpointError", error
    assert "restore of step 1: rank 1 failed" in error["message"], error
    assert "StateMismatchError" in error["message"] and "mid1" in error["message"], error
    assert error["failures"] == {"1": "StateMismatchError"}, error
    for rec in (own, other):
        assert rec["error"]["elapsed"] < TIMEOUT, rec  # learnt through the exchange, not after a timeout
        assert rec.get("saved_after"), rec
