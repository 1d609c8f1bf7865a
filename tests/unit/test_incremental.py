"""Incremental saves (docs/format.md section 9): unchanged shards are referenced, not written; every
checkpoint stays restorable bit for bit, through retention, corruption and copies, on a disk and in mem://."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiersave
from tiersave import knobs
from tiersave.catalog import Catalog
from tiersave.cli import main as cli
from tiersave.format.manifest import Manifest
from tiersave.storage import open_storage

MiB = 1 << 20


def lora_state(seed: int = 0) -> dict:
    """>= 90% of the bytes frozen: a large base weight, a small adapter and an optimizer-ish small state."""
    g = torch.Generator().manual_seed(seed)
    return {
        "base": torch.randn(2048, 1024, generator=g),  # 8 MiB + a bit: a shard of its own
        "head": torch.randn(3 * 1024 * 1024 // 4, generator=g),  # 3 MiB, grouped with the small ones
        "lora_a": torch.randn(64, 256, generator=g),
        "lora_b": torch.zeros(256, 64),
        "step_count": 0,
    }


def train_step(state: dict) -> None:
    state["lora_a"] += 0.5
    state["lora_b"] -= 0.25
    state["step_count"] += 1


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def snapshot(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def save_chain(root: Path, steps: tuple[int, ...]) -> dict:
    """Incremental saves of a training LoRA-like state at ``steps``; returns the state as last saved."""
    state = lora_state()
    with tiersave.Checkpointer(root, incremental=True) as ckpt:
        for step in steps:
            train_step(state)
            ckpt.save(step, state).result()
    return state


def manifest(root: Path | str, step: int) -> Manifest:
    return Catalog(open_storage(str(root))).manifest(step)


def test_unchanged_shards_are_referenced_and_every_step_restores(root):
    state, saved = lora_state(), {}
    with knobs.override_content_hash("sha256"), tiersave.Checkpointer(root, incremental=True) as ckpt:
        for step in (10, 20, 30):
            train_step(state)
            ckpt.save(step, state).result()
            saved[step] = snapshot(state)
        for step, expected in saved.items():
            assert_same(ckpt.restore(step), expected)
    first, later = manifest(root, 10), [manifest(root, s) for s in (20, 30)]
    assert json.loads((root / "step-0000000010" / "manifest.json").read_bytes())["format_version"] == "1.2"
    assert json.loads((root / "step-0000000030" / "manifest.json").read_bytes())["format_version"] == "2.0"
    assert first.referenced_bytes == 0
    for m in later:
        # references name the step that holds the bytes (10), never another reference
        assert m.referenced_steps == {10}
        assert m.referenced_bytes >= 0.7 * m.stored_bytes
        assert m.stats["referenced_bytes"] == m.referenced_bytes
    # the referenced shard exists once on disk
    assert not any(p.name == "shard-00000-000.bin" for p in (root / "step-0000000030").iterdir())


def test_plain_checkpoints_stay_1_1(root):
    with tiersave.Checkpointer(root) as ckpt:
        ckpt.save(1, lora_state())
    doc = json.loads((root / "step-0000000001" / "manifest.json").read_bytes())
    assert doc["format_version"] == "1.1"
    assert all(set(s) == {"file", "rank", "size"} for s in doc["shards"])


def test_full_every_forces_a_full_save(root):
    state = lora_state()
    with tiersave.Checkpointer(root, incremental=True, full_every=2) as ckpt:
        for step in range(1, 6):
            train_step(state)
            ckpt.save(step, state).result()
    refs = {s: manifest(root, s).referenced_steps for s in range(1, 6)}
    assert refs == {1: set(), 2: {1}, 3: set(), 4: {3}, 5: set()}


def test_retention_keeps_referenced_steps_until_no_kept_checkpoint_needs_them(root):
    state = lora_state()
    with tiersave.Checkpointer(root, incremental=True, full_every=3, keep_last=1) as ckpt:
        for step in range(1, 4):
            train_step(state)
            ckpt.save(step, state).result()
        # 2 went; 1 holds the base weights that 3 references
        assert [i.step for i in ckpt.list()] == [1, 3]
        train_step(state)
        ckpt.save(4, state).result()  # full: nothing references 1 any more
        assert [i.step for i in ckpt.list()] == [4]
        assert_same(ckpt.restore(4), state)


def test_a_corrupt_referenced_shard_is_detected_in_every_checkpoint_using_it(root):
    save_chain(root, (1, 2, 3))
    shard = root / "step-0000000001" / "shard-00000-000.bin"
    with shard.open("r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0x10]))
    with tiersave.Checkpointer(root) as ckpt:
        for step in (1, 2, 3):
            report = ckpt.verify(step)
            assert not report.ok and "shard-00000-000.bin" in " ".join(report.errors), step
            with pytest.raises(tiersave.CorruptCheckpointError) as info:
                ckpt.restore(step)
            assert "base" in str(info.value)


def test_a_missing_referenced_step_is_a_clear_error(root):
    save_chain(root, (1, 2))
    (root / "step-0000000001" / "shard-00000-000.bin").unlink()
    with tiersave.Checkpointer(root) as ckpt, pytest.raises(tiersave.CorruptCheckpointError) as info:
        ckpt.restore(2)
    assert "step 2: shard shard-00000-000.bin (referenced in step 1) is missing from" in str(info.value)


def test_a_partly_changed_tensor_is_written_whole_from_the_base(root):
    """Pieces of one shard that match are completed from the base's copy: no shard is half referenced."""
    big = torch.arange(16 * MiB // 4, dtype=torch.float32)  # 16 MiB: 4 chunks of 4 MiB
    with tiersave.Checkpointer(root, incremental=True, chunk_bytes=4 * MiB) as ckpt:
        ckpt.save(1, {"w": big}).result()
        big[5] = -1.0  # only the first chunk changes
        handle = ckpt.save(2, {"w": big})
        handle.result()
        assert_same(ckpt.restore(2), {"w": big})
    m = manifest(root, 2)
    assert m.referenced_bytes == 0 and (root / "step-0000000002" / "shard-00000-000.bin").stat().st_size == 16 * MiB


def test_copy_of_an_incremental_checkpoint_is_self_contained(root, tmp_path):
    state = save_chain(root, (1, 2))
    dst = tmp_path / "copy"
    assert cli(["copy", str(root), str(dst), "--step", "2"]) == 0
    copied = manifest(dst, 2)
    assert copied.referenced_bytes == 0
    assert json.loads((dst / "step-0000000002" / "manifest.json").read_bytes())["format_version"] == "1.1"
    with tiersave.Checkpointer(dst) as ckpt:
        assert ckpt.verify(2).ok
        assert_same(ckpt.restore(2), state)


def test_mem_first_tier_drains_full_copies_to_disk(tmp_path):
    state = lora_state()
    mem = f"mem://incr-{uuid.uuid4().hex}"
    disk = tmp_path / "disk"
    with tiersave.Checkpointer(tiers=[tiersave.Tier(mem, keep=1), tiersave.Tier(disk)], incremental=True) as ckpt:
        for step in (1, 2, 3):
            train_step(state)
            ckpt.save(step, state).result()
        ckpt.wait()
        ckpt.prune(1, tier=ckpt.tiers[0])  # the automatic one may have found 2 still being drained
        first = Catalog(ckpt.storage)
        assert first.steps() == [1, 3]  # 1 holds what 3 references
        assert first.manifest(3).referenced_steps == {1}
        assert_same(ckpt.restore(3), state)
    assert manifest(disk, 3).referenced_bytes == 0  # a drained copy is self-contained
    with tiersave.Checkpointer(disk) as ckpt:
        assert_same(ckpt.restore(3), state)


@pytest.mark.parametrize(
    ("incremental", "full_every", "fragment"),
    [
        ("yes", None, "incremental must be True or False"),
        (True, 0, "full_every must be a positive integer"),
        (True, True, "full_every must be a positive integer"),
        (False, 3, "full_every applies to incremental saves"),
    ],
)
def test_bad_options_are_clear_errors(root, incremental, full_every, fragment):
    with pytest.raises(tiersave.ConfigError, match=fragment):
        tiersave.Checkpointer(root, incremental=incremental, full_every=full_every)


# -- any sequence of saves and prunes ------------------------------------------------------------------


ops = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.sets(st.sampled_from(["a", "b", "c", "d"]), max_size=4)),
        st.tuples(st.just("prune"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, full_every=st.one_of(st.none(), st.integers(1, 4)))
def test_any_sequence_of_saves_and_prunes_restores_every_kept_checkpoint(tmp_path, ops, full_every):
    root = tmp_path / uuid.uuid4().hex
    state = {
        "a": torch.zeros(300_000),  # > 1 MiB: their own unit (and, at 64 KiB chunks, several)
        "b": torch.ones(600_000),
        "c": torch.arange(1000.0),
        "d": torch.full((7,), 3.0),
    }
    saved: dict[int, dict] = {}
    step = 0
    with tiersave.Checkpointer(root, incremental=True, full_every=full_every, chunk_bytes=256 * 1024) as ckpt:
        for op, arg in ops:
            if op == "save":
                for name in arg:
                    state[name][step % state[name].numel()] += 1
                step += 1
                ckpt.save(step, state).result()
                saved[step] = snapshot(state)
            else:
                ckpt.prune(arg)
        kept = [i.step for i in ckpt.list()]
        assert set(kept) <= set(saved) and (not saved or max(saved) in kept)
        for s in kept:
            assert_same(ckpt.restore(s), saved[s])
            assert ckpt.verify(s).ok


def test_inspect_shows_bytes_written_and_referenced(root, capsys):
    save_chain(root, (1, 2))
    assert cli(["inspect", str(root), "--step", "2"]) == 0
    text = capsys.readouterr().out
    m = manifest(root, 2)
    assert f"format {m.format_version}" in text and m.format_version in ("2.0", "2.1")
    assert f"referenced (held by step 1); pieces hashed with {m.content_hash}" in text
    assert cli(["inspect", str(root), "--step", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["referenced_bytes"] == m.referenced_bytes > 0
    assert doc["written_bytes"] == m.stored_bytes - m.referenced_bytes
    assert doc["referenced_steps"] == [1]
    assert doc["content_hash"] == m.content_hash


def test_export_resolves_references(root, tmp_path):
    from safetensors.torch import load_file

    state = save_chain(root, (1, 2))
    out = tmp_path / "two.safetensors"
    assert cli(["export", str(root), "--step", "2", "--to", str(out)]) == 0
    exported = load_file(out)
    for name in ("base", "head", "lora_a", "lora_b"):
        assert torch.equal(exported[name], state[name]), name


def test_a_referenced_step_deleted_by_another_process_fails_the_save_and_the_next_one_is_full(root):
    state = lora_state()
    with tiersave.Checkpointer(root, incremental=True) as ckpt:
        for step in (1, 2):
            train_step(state)
            ckpt.save(step, state).result()
        Catalog(open_storage(str(root))).delete(1)  # as a prune in another process would, unaware of 2's needs
        train_step(state)
        with pytest.raises(tiersave.SaveError, match="step 3: step 1, whose shards this incremental save references"):
            ckpt.save(3, state).result()
        assert [i.step for i in ckpt.list()] == [2]
        ckpt.save(4, state).result()
        assert manifest(root, 4).referenced_steps == set()
        assert_same(ckpt.restore(4), state)
