"""benchmarks/profile_stages.py: a tiny run prints its table, and perf stacks are attributed to the right
stage (the figures in docs/benchmarks.md depend on that attribution)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_stages.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_stages", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stack(*frames: str) -> str:
    return "python \n" + "\n".join(f"\tffffffff81000000 {f} ([kernel.kallsyms])" for f in frames)


def test_stacks_are_attributed_to_their_stage() -> None:
    stage_of = _module().stage_of
    # a direct read into new memory: the first touch inside the read is counted as page faults
    assert stage_of(_stack("clear_page_erms", "handle_mm_fault", "__get_user_pages", "do_preadv")) == "page faults"
    assert stage_of(_stack("iomap_dio_rw", "ext4_file_read_iter", "do_preadv", "preadv64v2")) == "read syscall"
    assert stage_of(_stack("iomap_dio_rw", "ext4_file_write_iter", "vfs_write", "pwrite64")) == "write syscall"
    assert stage_of(_stack("_crc32c_hw_adler", "_PyEval_EvalFrameDefault")) == "checksum"
    assert stage_of(_stack("__memmove_avx_unaligned_erms", "libpython3.11.so")) == "copy"
    assert stage_of(_stack("drop_pagecache_sb", "drop_caches_sysctl_handler", "vfs_write")) == "evict"
    assert stage_of(_stack("_PyEval_EvalFrameDefault (libpython3.11.so.1.0)")) == "python"
    assert stage_of(_stack("at::native::copy_")) == "other"


def test_tiny_run_prints_every_operation(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env["TIERSAVE_IO_CALIBRATION_BYTES"] = str(4 << 20)
    args = ["--dir", str(tmp_path), "--size", "0.01", "--reps", "1", "--no-drop-caches"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env, check=True
    ).stdout
    for op in ("save", "restore_into", "restore_new"):
        assert f"| {op} |" in out, out
    assert "raw direct write" in out
