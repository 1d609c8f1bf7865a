"""benchmarks/memmove_pieces.py: a tiny run times every way of copying it names, the streaming copy included
where it was built."""

from __future__ import annotations

from helpers import run_benchmark
from tiersave.engine.memcopy import stream_available


def test_tiny_run_times_each_copy_routine() -> None:
    done = run_benchmark("memmove_pieces.py", "--mb", "16", "--state-gb", "0.05", "--reps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split()[0:4] for line in done.stdout.splitlines() if line.startswith("  ")]
    assert len(rows) == 6 + 4 + (2 if stream_available() else 0), done.stdout
    for name in ("one memmove", "equal halves, one per thread", "torch copy_ (DLRover-like)"):
        assert name in done.stdout
    if stream_available():
        assert "stream-" in done.stdout and "copy_many, stream-" in done.stdout
    assert done.stdout.count("GB/s") == len(rows)
