"""benchmarks/ranks_restore.py and shared_read_order.py: tiny runs time every variant the docs quote
(docs/benchmarks.md, "The 2-rank replicated restore, 2026-11-24") and print their medians."""

from __future__ import annotations

import re
import socket
from pathlib import Path

from test_many_tensors_scripts import _run  # the same tiny-run helper

from helpers import run_benchmark


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_ranks_restore_times_each_variant_on_both_ranks_and_summarizes(tmp_path: Path) -> None:
    out = _run(
        "ranks_restore.py",
        *("--ranks", "2", "--size", "4MB", "--reps", "1", "--dir", str(tmp_path), "--port", str(_free_port())),
        *("--variants", "checks-all,rotated,runs=1", "--chunk", "1MiB"),
        cwd=tmp_path,
    )
    for name in ("tiersave", "tiersave-checks-all", "tiersave-rotated", "tiersave-runs=1", "dcp"):
        for rank in (0, 1):
            assert f"rank {rank} rep 0 {name}: " in out, out
        assert re.search(rf"^  {re.escape(name)} +median [0-9.]+ s  vs DCP [0-9.]+x", out, re.M), out
    assert "left to the other ranks 0.00 GB" in out  # checks-all checked everything itself
    assert list(tmp_path.iterdir()) == []  # the checkpoints are removed


def test_ranks_restore_refuses_an_unknown_variant(tmp_path: Path) -> None:
    done = run_benchmark("ranks_restore.py", "--variants", "fast", timeout=120)
    assert done.returncode == 2 and "unknown variant 'fast'" in done.stderr, done.stderr


def test_shared_read_order_times_the_three_orders(tmp_path: Path) -> None:
    out = _run(
        "shared_read_order.py",
        *("--dir", str(tmp_path), "--size", "4MiB", "--chunk", "1MiB", "--reps", "1"),
        cwd=tmp_path,
    )
    for order in ("same", "own-first", "own-first+willneed"):
        assert f"rep 0 {order}: " in out and re.search(rf"^  {re.escape(order)} +[0-9.]+ s", out, re.M), out
    assert list(tmp_path.iterdir()) == []  # the files are removed
