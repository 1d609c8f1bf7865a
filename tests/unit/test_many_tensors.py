"""States of very many tensors (issue 15): small tensors are staged, checksummed, written and read in groups.

What must hold with groups exactly as without: bit-exact round trips (mixed sizes and dtypes, tied tensors and
views inside groups, groups cut by large tensors and by a ring smaller than the save), snapshot isolation
after ``save_async`` returns, and a corrupted small tensor inside a group reported by its own name. Medium
tensors (an MoE's experts of a few MiB) are read in vectored runs: round trips new and in place, on every
reader, few requests per run, and a corrupted expert inside a run named.
"""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tiersave import Checkpointer
from tiersave.engine.pipeline import plan_save
from tiersave.errors import CorruptCheckpointError
from tiersave.format.layout import ALIGN, align_up
from tiersave.state import flatten
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16, torch.uint8, torch.complex64]


def _small(i: int, g: torch.Generator) -> torch.Tensor:
    dtype = DTYPES[i % len(DTYPES)]
    shape = [(), (0,), (7,), (3, 5), (64,), (16, 16)][i % 6]
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in (torch.int64, torch.uint8):
        return torch.randint(0, 200, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _mixed_state(count: int) -> dict:
    g = torch.Generator().manual_seed(count)
    experts = {f"e{i}": _small(i, g) for i in range(count)}
    base = torch.arange(4096, dtype=torch.float32)
    big = torch.randn(600_000, generator=g)  # 2.4 MB: its own units, cutting the run of small ones in two
    return {
        "experts": experts,
        "big": big,
        "base": base,
        "tail": {f"t{i}": _small(i, g) for i in range(200)},
        "tied_a": experts["e10"],  # the same tensor twice, inside a group
        "tied_b": experts["e10"],
        "view": base[100:164],  # a view of another saved tensor
        "strided": base.view(64, 64)[:, ::2],  # a non-contiguous view
        "transposed": torch.randn(8, 8, generator=g).t(),
        "step": 7,
    }


def _assert_same(saved: dict, restored: dict) -> None:
    for k, t in saved["experts"].items():
        r = restored["experts"][k]
        assert r.dtype == t.dtype and tuple(r.shape) == tuple(t.shape), k
        assert _bits(r) == _bits(t), k
    for k in ("big", "base", "view", "strided", "transposed"):
        assert _bits(restored[k]) == _bits(saved[k]), k
    for k, t in saved["tail"].items():
        assert _bits(restored["tail"][k]) == _bits(t), k
    assert restored["step"] == 7


def test_plan_groups_small_tensors_and_keeps_large_ones_chunked() -> None:
    flat = flatten(_mixed_state(3000))
    chunk = 1 << 20
    plan = plan_save(flat.tensors, chunk_bytes=chunk, shard_file=lambda i: f"s{i}")
    groups = [u for u in plan.units if u.is_group]
    assert groups and len(plan.units) < len(flat.tensors) / 50
    covered = [i for u in groups for i in range(u.tensor, u.end)]
    assert len(covered) == len(set(covered))
    big = next(i for i, t in enumerate(flat.tensors) if t.name == "big")
    assert [u.chunk for u in plan.units if not u.is_group and u.tensor == big] == [0, 1, 2]
    # units tile the shard exactly, in order, each at most one chunk, and groups are aligned runs
    cursor = 0
    for u in plan.units:
        assert u.file_offset == cursor and u.file_offset % ALIGN == 0 and u.padded <= chunk
        cursor += u.padded
    assert cursor == plan.shards[0].size


def test_round_trip_of_100k_tensors_is_bit_exact() -> None:
    state = _mixed_state(100_000)
    storage = MemoryStorage(f"many-{uuid.uuid4().hex[:12]}")
    try:
        with Checkpointer(storage, event_log=False, handle_sigterm=False) as ck:
            handle = ck.save(1, state)
            assert handle.stats.num_tensors > 80_000  # (empty tensors of one dtype and shape are stored once)
            restored = ck.restore(1)
        _assert_same(state, restored)
        assert restored["tied_a"] is restored["tied_b"]
    finally:
        storage.destroy()


def test_round_trip_through_a_ring_smaller_than_the_save(tmp_path) -> None:
    """A 64 KiB staging budget: groups are cut small and wrap around the end of the ring."""
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(int(torch.randint(1, 900, (1,), generator=g)), generator=g) for i in range(3000)}
    with Checkpointer(tmp_path, staging_bytes=64 << 10, event_log=False, handle_sigterm=False) as ck:
        ck.save(1, state)
        ck.save_async(2, state).result(timeout=120)
        for step in (1, 2):
            restored = ck.restore(step)
            assert all(_bits(restored[k]) == _bits(v) for k, v in state.items())


def test_changes_after_save_async_never_leak_into_grouped_tensors(tmp_path) -> None:
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(20_000)}
    with Checkpointer(tmp_path, event_log=False, handle_sigterm=False) as ck:
        handle = ck.save_async(1, state)
        for t in state.values():  # the training loop moves on at once
            t.add_(1000.0)
        handle.result(timeout=120)
        restored = ck.restore(1)
    for i in range(20_000):
        assert torch.equal(restored[f"w{i}"], torch.full((256,), float(i))), i


def test_live_restore_into_many_small_tensors(tmp_path) -> None:
    state = {f"w{i}": torch.randn(32) for i in range(5000)}
    live = {k: torch.zeros(32) for k in state}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    with Checkpointer(tmp_path, event_log=False, handle_sigterm=False) as ck:
        ck.save(1, state)
        out = ck.restore(1, into=live)
    assert out is live
    assert all(live[k].data_ptr() == ptrs[k] and torch.equal(live[k], state[k]) for k in state)


def _save_and_flip_a_bit(tmp_path, state: dict, victim: str, where: Callable[[dict], int]) -> Path:
    """Save ``state`` as step 1, then flip one bit of ``victim``'s bytes at ``where(its manifest entry)``;
    returns the shard file."""
    with Checkpointer(tmp_path, event_log=False, handle_sigterm=False) as ck:
        ck.save(1, state)
    step_dir = next(tmp_path.glob("step-*"))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    entry = manifest["tensors"][victim]
    shard = step_dir / manifest["shards"][entry["shard"]]["file"]
    with open(shard, "r+b") as f:
        f.seek(where(entry))
        byte = f.read(1)
        f.seek(where(entry))
        f.write(bytes([byte[0] ^ 0x40]))
    return shard


def test_corrupt_small_tensor_inside_a_group_is_named(tmp_path) -> None:
    state = {f"w{i}": torch.randn(64) for i in range(5000)}
    victim = "w2345"
    _save_and_flip_a_bit(tmp_path, state, victim, lambda entry: entry["offset"] + 17)
    with Checkpointer(tmp_path, event_log=False, handle_sigterm=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CorruptCheckpointError) as info:
            ck.restore(1)
        assert info.value.tensor == victim
        assert repr(victim) in str(info.value)
        live = {k: torch.zeros(64) for k in state}
        with pytest.raises(CorruptCheckpointError) as info:
            ck.restore(1, into=live)
        assert info.value.tensor == victim
        # the corrupted tensor's live memory never received the bad bytes
        assert torch.equal(live[victim], torch.zeros(64))


@pytest.mark.parametrize(
    "numel",
    [3, 20_001],  # tiny tensors, staged inline; groups of 80 KB ones, staged by the copier's threads
)
def test_padding_between_grouped_tensors_is_zero(tmp_path, numel: int) -> None:
    """The arena is reused across saves: stale bytes must not reach the padding the format requires zero."""
    big = {f"w{i}": torch.full((max(1024, numel + 64),), -1.0) for i in range(100)}  # non-zero bytes in the arena
    small = {f"w{i}": torch.arange(numel, dtype=torch.float32) + i for i in range(100)}
    with Checkpointer(tmp_path, event_log=False, handle_sigterm=False) as ck:
        ck.save(1, big)
        ck.save_async(2, small).result(timeout=60)
        ck.save(3, small)
        for step in (2, 3):
            assert ck.catalog.verify(step).ok
            restored = ck.restore(step)
            assert all(torch.equal(restored[k], v) for k, v in small.items())
    for step in (2, 3):  # the async save stages in bulk, the blocking one overlaps copies with writes
        step_dir = next(tmp_path.glob(f"step-*000{step}"))
        manifest = json.loads((step_dir / "manifest.json").read_text())
        data = (step_dir / manifest["shards"][0]["file"]).read_bytes()
        for entry in manifest["tensors"].values():
            end = entry["offset"] + entry["nbytes"]
            assert data[end : align_up(end)] == bytes(align_up(end) - end)


def test_flatten_fast_path_tells_views_apart_and_gives_addresses_only_for_plain_host_tensors() -> None:
    base = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    c = torch.randn(3, dtype=torch.complex64)
    state = {
        "w": base,
        "tied": base,  # the same view: stored once
        "flat": base.view(16),  # same memory, another shape
        "t": base.t(),  # same start, shape and dtype, other strides
        "row": base[1:],
        "c": c,
        "conj": c.conj(),  # same memory as c, the conjugate bit
        "neg": torch._neg_view(base),  # same memory and strides as w, the negative bit
        "imag": c.conj().imag,  # a real view with the negative bit
    }
    flat = flatten(state)
    names = {t.name: t for t in flat.tensors}
    assert flat.tree["tied"] == flat.tree["w"]
    assert set(names) == {"w", "flat", "t", "row", "c", "conj", "neg", "imag"}
    plain = {n for n, t in names.items() if t.address is not None}
    assert plain == {"w", "flat", "row", "c"}
    assert names["row"].address == base[1:].data_ptr()
    assert [names[n].nbytes for n in ("w", "row", "c")] == [64, 48, 24]
    # a sparse or meta tensor of a dtype the fast path knows still gets its own error
    for bad, fragment in ((base.to_sparse(), "to_dense"), (torch.empty(2, device="meta"), "meta tensor")):
        with pytest.raises(Exception, match=fragment):
            flatten({"ok": base, "bad": bad})


def test_fast_path_views_round_trip_bit_exact(tmp_path) -> None:
    base = torch.randn(8, 8)
    c = torch.randn(5, dtype=torch.complex64)
    state = {"w": base, "t": base.t(), "neg": torch._neg_view(base), "conj": c.conj(), "imag": c.conj().imag}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    with Checkpointer(str(tmp_path / "ck")) as ck:
        ck.save(1, state)
        got = ck.restore(1)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def _moe_state() -> dict[str, torch.Tensor]:
    """Medium tensors (one checksum chunk each, a few MiB) of mixed dtypes and odd sizes, so that runs hold
    padding between tensors and unaligned tails, plus one view of an expert and one tied pair."""
    g = torch.Generator().manual_seed(15)
    state: dict[str, torch.Tensor] = {}
    for i in range(24):
        n = [(1 << 18) + 1, 1 << 19, (3 << 18) + 7, 1 << 20][i % 4]  # float32 elements: 1-4 MiB
        t = torch.randn(n, generator=g)
        state[f"layers.{i // 8}.experts.{i % 8}.w"] = t.to(torch.bfloat16) if i % 3 == 0 else t
    state["tied"] = state["layers.0.experts.1.w"]
    state["view"] = state["layers.1.experts.1.w"][1000:300_000]
    return state


@pytest.mark.parametrize("io", ["direct", "buffered", "memory"])
def test_medium_tensors_round_trip_in_runs_new_and_live(tmp_path, io: str) -> None:
    """Direct (vectored runs), buffered (range by range) and mem:// (a reader without read_ranges)."""
    state = _moe_state()
    storage = MemoryStorage(f"runs-{uuid.uuid4().hex[:12]}") if io == "memory" else LocalStorage(tmp_path, io=io)
    try:
        with Checkpointer(storage, event_log=False, handle_sigterm=False) as ck:
            ck.save(1, state)
            restored = ck.restore(1)
            for k, t in state.items():
                assert _bits(restored[k]) == _bits(t), k
            # torch's own allocations sit 64 bytes past a page: every run of a live state bounces
            live = {k: torch.zeros_like(v) for k, v in state.items() if k not in ("tied", "view")}
            live["tied"] = live["layers.0.experts.1.w"]
            ptrs = {k: v.data_ptr() for k, v in live.items()}
            out = ck.restore(1, into=live, keys=[k for k in state if k != "view"])
            assert out is live
            for k, v in live.items():
                assert v.data_ptr() == ptrs[k] and _bits(v) == _bits(state[k]), k
    finally:
        if isinstance(storage, MemoryStorage):
            storage.destroy()


def test_medium_tensors_are_read_in_few_requests(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiersave.storage.posix import vectored

    calls: list[int] = []
    real = vectored.os.preadv

    def counting(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    state = {f"e{i}": torch.randn(1 << 20) for i in range(32)}  # 32 x 4 MiB
    with Checkpointer(LocalStorage(tmp_path, io="direct"), event_log=False, handle_sigterm=False) as ck:
        ck.save(1, state)
        monkeypatch.setattr(vectored.os, "preadv", counting)
        restored = ck.restore(1)
    assert all(torch.equal(restored[k], v) for k, v in state.items())
    assert sum(calls) == 32 and len(calls) <= 8  # runs of 4 MiB tensors, not one request per tensor


def test_corrupt_medium_tensor_inside_a_run_is_named(tmp_path) -> None:
    state = _moe_state()
    victim = "layers.1.experts.5.w"
    # in its unaligned tail, which is read through a bounce buffer
    shard = _save_and_flip_a_bit(tmp_path, state, victim, lambda entry: entry["offset"] + entry["nbytes"] - 3)
    with Checkpointer(tmp_path, event_log=False, handle_sigterm=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for into in (None, {k: torch.zeros_like(v) for k, v in state.items()}):
            with pytest.raises(CorruptCheckpointError) as info:
                ck.restore(1, into=into)
            assert info.value.tensor == victim
            assert repr(victim) in str(info.value) and shard.name in str(info.value)
