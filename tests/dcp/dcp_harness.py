"""Run a function on N real processes joined by a gloo process group on 127.0.0.1.

Each rank reports through a file in ``outdir`` (``rank-R.ok`` or ``rank-R.err`` with the traceback), so
nothing is pickled back. ``run_ranks`` bounds the whole run by ``timeout_s`` and kills every process
it started that is still alive, then fails with every rank's report.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

_CTX: Any = None


def _context() -> Any:
    """A forkserver that has imported torch and the workers once: each rank then starts in a fraction of a
    second instead of importing torch again (which takes seconds on a busy machine). Fork from the test
    process itself is unsafe once torch has started its thread pools."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["dcp_workers"])
    return _CTX


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, outdir: str, target: str, args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    report = Path(outdir) / f"rank-{rank}"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        try:
            module, _, name = target.rpartition(".")
            getattr(importlib.import_module(module), name)(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        report.with_suffix(".err").write_text(traceback.format_exc())
        os._exit(1)
    report.with_suffix(".ok").write_text("ok")


def run_ranks(target: str, world_size: int, *args: Any, outdir: Path, timeout_s: float = 90.0) -> None:
    """Run ``target(rank, world_size, *args)`` (a "module.function" name) on ``world_size`` processes."""
    outdir.mkdir(parents=True, exist_ok=True)
    ctx = _context()
    port = free_port()
    # Not daemonic: a rank may start processes of its own (DCP's process-based async_save); leftovers are
    # killed below.
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, str(outdir), target, args)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
        for p in alive:
            p.join(10)
    errors = {r: (outdir / f"rank-{r}.err") for r in range(world_size)}
    reports = [f"rank {r}:\n{path.read_text()}" for r, path in errors.items() if path.exists()]
    if alive:
        reports.append(f"ranks {[procs.index(p) for p in alive]} were still running after {timeout_s} s: killed")
    missing = [r for r in range(world_size) if not (outdir / f"rank-{r}.ok").exists()]
    if reports or missing:
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"{target} failed on ranks {missing} (exit codes {codes})\n" + "\n".join(reports))
