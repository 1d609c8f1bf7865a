"""A blocking save on buffered storage is written straight from the caller's tensors (engine/unstaged.py).

No staging copy is made (the arena is never allocated), the files hold exactly the bytes the staged path
writes (padding and checksums included), every kind of tensor arrives bit-exact, the saves that need staging
(``save_async``, direct I/O, incremental saves) keep it, and a failed write leaves nothing visible.
"""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest
import torch

from tiersave import Checkpointer
from tiersave.errors import StorageError
from tiersave.storage.memory import MemoryStorage
from tiersave.storage.posix import LocalStorage
from tiersave.storage.posix.blobs import LocalBlobWriter
from tiersave.testing.faults import Fault, FaultyStorage

KiB, MiB = 1 << 10, 1 << 20


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (NaN payloads and signed zeros compared exactly)."""
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _random(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype)


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(16)
    base = _random(3 * MiB // 4 + 123, torch.float32, g)
    tied = _random(5000, torch.float16, g)
    state: dict[str, object] = {
        "big_odd": _random(2 * MiB // 4 + 5, torch.float32, g),  # chunks of its own, a tail off the 4 KiB grid
        # a group of medium tensors (sizes off the 4 KiB grid): written from where they lie, one pwritev
        **{f"mid.{i}": _random(100_000 + 3 * i, torch.float32, g) for i in range(6)},
        "offset_view": base[1000:],  # a storage offset
        "strided": _random(1024 * 700, torch.float32, g).view(1024, 700).t(),  # not contiguous
        "conj": torch.complex(_random(300_000, torch.float32, g), _random(300_000, torch.float32, g)).conj(),
        "bf16": _random(3 * MiB // 2 + 7, torch.bfloat16, g),
        "f64": _random(1000, torch.float64, g),
        "i8": _random(17, torch.int8, g),
        "bool": torch.rand(333, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "tied_a": tied,
        "tied_b": tied,  # the same tensor twice: stored once
        "tied_view": tied[10:20],  # a view into it
        "np": np.arange(1000, dtype=np.int32),
        "np_strided": np.arange(4000, dtype=np.float64).reshape(40, 100)[:, ::3],
    }
    for i in range(300):  # tiny tensors: groups
        state[f"tiny.{i}"] = _random(1 + i * 7, torch.float32 if i % 2 else torch.int16, g)
    return state


def _check(out: dict[str, object], state: dict[str, object]) -> None:
    assert set(out) == set(state)
    for key, want in state.items():
        got = out[key]
        if isinstance(want, np.ndarray):
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape, key
            assert np.array_equal(got, want), key
            continue
        assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(_bits(got), _bits(want)), key


def _shards(root: Path, step: int) -> dict[str, bytes]:
    step_dir = next(p for p in root.iterdir() if p.name.startswith("step-") and p.name.endswith(str(step)))
    return {p.name: p.read_bytes() for p in sorted(step_dir.iterdir()) if p.name != "manifest.json"}


def test_blocking_buffered_save_makes_no_staging_copy_and_is_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    vectored: list[int] = []
    real = LocalBlobWriter.write_pieces

    def spy(self: LocalBlobWriter, offset: int, pieces: list[memoryview]) -> None:
        vectored.append(len(pieces))
        real(self, offset, pieces)

    monkeypatch.setattr(LocalBlobWriter, "write_pieces", spy)
    with Checkpointer(LocalStorage(tmp_path, io="buffered"), chunk_bytes=MiB, event_log=False) as ck:
        handle = ck.save(1, state)
        assert len(vectored) >= 3 and min(vectored) >= 4  # the medium tensors in groups of two, with zeros after each
        assert handle.stats.extra.get("unstaged") is True
        assert ck._saver.arena.allocations == 0 and ck._saver.arena.capacity == 0  # no arena, no copy
        out = ck.restore(1)
        assert out["tied_a"] is out["tied_b"]  # still one tensor
        _check(out, state)
        assert ck.verify(1).ok


def test_unstaged_files_equal_the_staged_ones_byte_for_byte(tmp_path: Path) -> None:
    """Same bytes on disk (zero padding included) and the same checksums as a save that stages."""
    state = _state()
    roots = {"unstaged": tmp_path / "a", "staged": tmp_path / "b"}
    infos = {}
    for name, root in roots.items():
        with Checkpointer(LocalStorage(root, io="buffered"), chunk_bytes=MiB, event_log=False) as ck:
            handle = ck.save(1, state, blocking=name == "unstaged")
            handle.result()
            assert bool(handle.stats.extra.get("unstaged")) is (name == "unstaged")
            infos[name] = {k: (t.offset, t.crc32c) for k, t in ck.catalog.manifest(1).tensors.items()}
    assert infos["unstaged"] == infos["staged"]
    assert _shards(roots["unstaged"], 1) == _shards(roots["staged"], 1)


def test_saves_that_need_staging_keep_it(tmp_path: Path) -> None:
    state = {"w": torch.randn(300_000), "b": torch.randn(10)}
    with Checkpointer(LocalStorage(tmp_path / "direct", io="direct"), event_log=False) as ck:
        assert "unstaged" not in ck.save(1, state).stats.extra  # direct I/O wants the aligned arena
        assert ck._saver.arena.allocations == 1
    with Checkpointer(LocalStorage(tmp_path / "async", io="buffered"), event_log=False) as ck:
        handle = ck.save(1, state, blocking=False)  # snapshot isolation needs the copy
        handle.result()
        assert "unstaged" not in handle.stats.extra
    with Checkpointer(LocalStorage(tmp_path / "inc", io="buffered"), incremental=True, event_log=False) as ck:
        assert "unstaged" not in ck.save(1, state).stats.extra  # compares against the arena's previous bytes


def test_incremental_saves_after_an_unstaged_save_are_correct(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}": torch.randn(5 * MiB // 4, generator=g) for i in range(3)}  # a shard each
    state["small"] = torch.arange(100)
    storage = LocalStorage(tmp_path, io="buffered")
    with Checkpointer(storage, event_log=False) as ck:
        assert ck.save(1, state).stats.extra.get("unstaged") is True
    want = {1: {k: v.clone() for k, v in state.items()}}
    with Checkpointer(storage, incremental=True, event_log=False) as ck:
        for step in (2, 3, 4):
            state["layer0"].add_(1.0)  # one tensor changes per save, the rest is referenced once possible
            state["small"][step] = -step
            ck.save(step, state)
            want[step] = {k: v.clone() for k, v in state.items()}
        for step, expected in want.items():
            out = ck.restore(step)
            assert all(torch.equal(out[k], v) for k, v in expected.items()), step
            assert ck.verify(step).ok
        assert ck.catalog.manifest(4).referenced_steps  # the chain really references earlier steps


def test_blocking_save_into_memory_tier_is_unstaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERSAVE_SHM_DIR", str(tmp_path / "shm"))
    state = _state()
    with Checkpointer(MemoryStorage("unstaged-test"), event_log=False) as ck:
        assert ck.save(1, state).stats.extra.get("unstaged") is True
        _check(ck.restore(1), state)


def test_a_failed_write_leaves_nothing_and_the_next_save_works(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(300_000) for i in range(8)}
    broken = FaultyStorage(
        LocalStorage(tmp_path, io="buffered"), [Fault("write_at", nth=3, error=lambda: OSError(errno.ENOSPC, "full"))]
    )
    with Checkpointer(broken, chunk_bytes=MiB, event_log=False) as ck:
        with pytest.raises(StorageError, match="full"):
            ck.save(1, state)
        assert ck.list() == []
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("step-")]
        ck.save(2, state)
        _check(ck.restore(2), state)  # type: ignore[arg-type]


def test_write_pieces_writes_more_pieces_than_one_pwritev_takes(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path, io="buffered")
    pieces = [memoryview(bytes([i % 251]) * (1 + i % 7)) for i in range(2500)]  # over IOV_MAX (1024) pieces
    want = b"".join(pieces)
    writer = storage.open_writer("f.bin")
    assert isinstance(writer, LocalBlobWriter)
    writer.write_pieces(4096, pieces)
    writer.finish(4096 + len(want))
    assert storage.get("f.bin") == bytes(4096) + want
