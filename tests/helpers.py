"""Helpers shared by the test modules (imported as ``from helpers import ...``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Tunables that make S3 tests exercise multipart uploads, split reads and back-pressure with small data.
S3_TEST_OPTIONS = {
    "part_size": "5MiB",
    "write_buffer": "15MiB",
    "read_part_size": "1MiB",
    "retries": "2",
    "timeout": "30s",
}


def listing(root: Path) -> list[str]:
    """Names in a checkpoint root, without the save event log (tiersave-events.jsonl), the writer lock and the
    read leases (``leases/``, made by the first read)."""
    skip = ("tiersave-writer.lock", "leases")
    return sorted(p.name for p in root.iterdir() if p.name not in skip and not p.name.startswith("tiersave-events"))


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Deep equality with exact tensor bytes, dtypes and shapes, and NaN == NaN."""
    import torch

    where = path or "<root>"
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), (
            f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        )
        if a.numel():
            from tiersave.state import as_bits

            ab = as_bits(a.detach()).cpu().contiguous().reshape(-1).view(torch.uint8)
            bb = as_bits(b.detach()).cpu().contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(ab, bb), f"{where}: tensor bytes differ"
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{where}: {type(b)} is not an ndarray"
        assert a.dtype.newbyteorder("<") == b.dtype.newbyteorder("<") and a.shape == b.shape, f"{where}"
        assert (
            np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()
            == np.ascontiguousarray(b).astype(b.dtype.newbyteorder("<")).tobytes()
        ), f"{where}: array bytes differ"
        return
    if isinstance(a, np.generic):
        assert type(a) is type(b) and a.tobytes() == b.tobytes(), f"{where}: {a!r} vs {b!r}"
        return
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: {type(b)} is not a dict"
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) or (isinstance(a, tuple) and type(b) is tuple), f"{where}: {type(a)} vs {type(b)}"
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
        return
    if isinstance(a, float):
        assert isinstance(b, float), f"{where}: {b!r} is not a float"
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), (
            f"{where}: {a!r} vs {b!r}"
        )
        return
    assert type(a) is type(b) and a == b, f"{where}: {a!r} ({type(a).__name__}) vs {b!r} ({type(b).__name__})"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``tiersave ARGV`` in-process: (exit code, stdout, stderr)."""
    from tiersave.cli import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_cli_json(capsys, *argv: str) -> dict:
    """Run ``tiersave ARGV --json``, which must succeed; its JSON document."""
    import json

    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    doc: dict = json.loads(out)
    return doc


def accepted_bit_flips(data: bytes) -> list[tuple[int, int]]:
    """Every (byte, bit) whose flip in manifest ``data`` parses to a manifest other than the original: a
    flip must either be refused (``FormatError``) or change nothing the manifest means."""
    from tiersave.errors import FormatError
    from tiersave.format.manifest import Manifest

    original = Manifest.parse(data, path="m")
    accepted = []
    for i in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            try:
                parsed = Manifest.parse(bytes(flipped), path="m")
            except FormatError:
                continue
            if parsed != original:
                accepted.append((i, bit))
    return accepted


def compact_written(doc: dict[str, Any]) -> dict[str, Any]:
    """Manifest document ``doc`` as a compact writer (format 4.x/5.x) writes it, however few its tensors."""
    from tiersave.format import compact
    from tiersave.format.manifest import Manifest, seal

    m = Manifest.parse(seal(doc), path="entries")
    saved, compact.COMPACT_MIN_TENSORS = compact.COMPACT_MIN_TENSORS, 1
    try:
        return json.loads(m.to_json())
    finally:
        compact.COMPACT_MIN_TENSORS = saved


def manifest_error(doc: dict[str, Any], exc_type: type[Exception] | None = None) -> str:
    """The message of the error (``FormatError`` unless told) that parsing ``doc``, sealed, raises."""
    from tiersave.errors import FormatError
    from tiersave.format.manifest import Manifest, seal

    with pytest.raises(exc_type or FormatError) as info:
        Manifest.parse(seal(doc), path="m.json")
    return str(info.value)


def worker_env(root: Path, timeout_s: float, **extra: str) -> dict[str, str]:
    """The environment of a tests/dist worker: its checkpoint root and coordination timeout, and ``extra``."""
    return {"TIERSAVE_TEST_ROOT": str(root), "TIERSAVE_DIST_TIMEOUT": str(timeout_s), **extra}


def manifest_doc(
    tensors: dict[str, Any],
    tree: Any,
    shards: list[dict[str, Any]],
    *,
    world_size: int = 1,
    version: str = "1.1",
    step: int = 3,
    chunk_bytes: int = 4096,
    metrics: dict[str, float] | None = None,
) -> dict[str, Any]:
    """An unsealed per-entry manifest document built by hand (the parser's input, docs/format.md section 4)."""
    return {
        "format": "tiersave",
        "format_version": version,
        "step": step,
        "created_at": "2026-11-23T00:00:00.000000Z",
        "world_size": world_size,
        "library": {"name": "tiersave", "version": "0"},
        "checksum": {"algorithm": "crc32c", "chunk_bytes": chunk_bytes},
        "shards": shards,
        "tensors": tensors,
        "tree": tree,
        "metrics": metrics or {},
        "tags": [],
        "metadata": {},
        "stats": {},
    }


def random_bytes(n: int, seed: int = 1) -> bytes:
    """``n`` reproducible pseudo-random bytes."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark(
    script: str, *args: str, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``benchmarks/<script>`` in a fresh interpreter on this checkout's sources; the finished process."""
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent / "src"))
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_refuses_a_busy_dir(script: str, tmp_path: Path, *args: str) -> None:
    """``script`` (a benchmark that removes its ``--dir`` at the end) refuses a directory holding a user's file,
    and a ``--json`` inside ``--dir``, touching neither."""
    (tmp_path / "keep.txt").write_text("a user's file")
    done = run_benchmark(script, "--dir", str(tmp_path), *args, timeout=60)
    assert done.returncode == 2 and "give a new or empty directory" in done.stderr
    assert (tmp_path / "keep.txt").read_text() == "a user's file"
    new = tmp_path / "new"
    done = run_benchmark(script, "--dir", str(new), *args, "--json", str(new / "r.json"), timeout=60)
    assert done.returncode == 2 and "--json must lie outside --dir" in done.stderr
    assert not new.exists()


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result or exception, run on a daemon thread that must return within ``seconds`` (a call that
    might block for good fails the test instead of hanging it)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} did not return within {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]
