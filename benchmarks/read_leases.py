"""Issue 12's read leases: what taking one costs a reader, per tier, side by side with the same read without one.

For each tier (a local directory, ``mem://``, and with ``--s3`` a SeaweedFS S3 server started for the run), one
checkpoint of ``--mb`` MiB is saved; then, reps interleaved, three operations are timed: ``lease`` (take and
release one read lease: the put, the check of the deletion record and of the commit, the delete), ``verify``
(read and check every byte of the checkpoint, which takes a lease) and ``verify-unleased`` (the same with the
lease switched off: what a read cost before leases). Medians over ``--reps`` reps of ``--ops`` operations each;
the load average is printed with the figures.

Usage::

    .venv/bin/python benchmarks/read_leases.py --mb 1 --reps 5 --ops 20 --s3 --dir DIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.storage import open_storage


def timed(op: Callable[[], Any], n: int) -> float:
    """Milliseconds per call of ``op``, over ``n`` calls."""
    start = time.perf_counter()
    for _ in range(n):
        op()
    return (time.perf_counter() - start) * 1e3 / n


def measure(uri: str, mb: int, reps: int, ops: int) -> dict[str, float]:
    storage = open_storage(uri)
    with tiersave.Checkpointer(storage, event_log=False) as writer:
        writer.save(1, {"w": torch.randn(mb << 18)})
    leased, unleased = Catalog(storage), Catalog(storage)
    unleased.leases.take = lambda step, referenced=(): None  # type: ignore[method-assign]

    def lease() -> None:
        taken = leased.leases.take(1)
        assert taken is not None
        taken.release()

    def verify(catalog: Catalog) -> Callable[[], None]:
        return lambda: None if catalog.verify(1).ok else (_ for _ in ()).throw(AssertionError("verify failed"))

    runs: dict[str, list[float]] = {"lease": [], "verify": [], "verify-unleased": []}
    ops_of = {"lease": lease, "verify": verify(leased), "verify-unleased": verify(unleased)}
    for rep in range(reps):
        order = list(runs)
        order = order[rep % 3 :] + order[: rep % 3]  # rotate: no method always runs first
        for name in order:
            runs[name].append(timed(ops_of[name], ops))
    return {name: statistics.median(values) for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=1, help="checkpoint size in MiB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ops", type=int, default=20, help="operations per rep")
    parser.add_argument("--dir", help="scratch directory for the local root (default: a temporary one)")
    parser.add_argument("--s3", action="store_true", help="also on a SeaweedFS S3 server started for the run")
    args = parser.parse_args()
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="tiersave-leases-")) / f"run-{uuid.uuid4().hex[:6]}"
    tiers = {"local": str(scratch / "root"), "mem": f"mem://leases-bench-{uuid.uuid4().hex[:6]}"}
    server = None
    if args.s3:
        from tiersave.testing.seaweed import SeaweedServer

        server = SeaweedServer.shared()
        os.environ.update(server.env())
        bucket = f"leases-{uuid.uuid4().hex[:8]}"
        server.storage(bucket, "run").close()  # creates the bucket
        tiers["s3"] = server.uri(bucket, "run")
    mem = open_storage(tiers["mem"])
    try:
        print(f"load average before: {os.getloadavg()}")
        print(f"{'tier':6} {'lease ms':>9} {'verify ms':>10} {'unleased ms':>12} {'lease share':>12}")
        for name, uri in tiers.items():
            got = measure(uri, args.mb, args.reps, args.ops)
            share = (got["verify"] - got["verify-unleased"]) / got["verify"] if got["verify"] else 0.0
            print(f"{name:6} {got['lease']:9.2f} {got['verify']:10.2f} {got['verify-unleased']:12.2f} {share:11.0%}")
        print(f"load average after: {os.getloadavg()}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        mem.destroy()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
