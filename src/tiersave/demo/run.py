"""``tiersave demo``: checkpoint a training run, kill it with SIGKILL, resume, compare bit for bit.

Three worker processes (``python -m tiersave.demo.train``):

1. *reference*: trains all steps without checkpoints;
2. *crashed*: trains with a checkpoint every ``--save-every`` steps and is killed with SIGKILL by this
   process right after step ``--kill-at`` (no cleanup, no atexit: as a node failure would stop it);
3. *resumed*: a fresh process that restores the newest committed checkpoint and trains to the end.

The demo passes when every loss of the resumed run, and its final weights, equal the reference run's
bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..catalog import Catalog
from ..errors import TiersaveError
from ..storage import open_storage
from ..units import human_bytes, table


class DemoError(TiersaveError):
    """The demonstration could not run (its worker process failed)."""


@dataclass
class RunLog:
    losses: dict[int, str] = field(default_factory=dict)
    saves: list[dict[str, Any]] = field(default_factory=list)
    restore: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    killed_at: int | None = None
    seconds: float = 0.0
    started: float = field(default_factory=time.perf_counter)


_WORKER_LIMIT_S = 1800.0
"""A demo worker still running after this is killed and reported (a healthy one takes well under a minute)."""


@dataclass
class _Worker:
    proc: subprocess.Popen[str]
    stderr: IO[str]  # a file, not a pipe nobody reads: a chatty worker never blocks on it


def _worker(args: list[str]) -> _Worker:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (the worker's lifetime: closed by _follow)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiersave.demo.train", *args], stdout=subprocess.PIPE, stderr=err, text=True, env=env
    )
    return _Worker(proc, err)


def _follow(worker: _Worker, log: RunLog, kill_at: int | None = None) -> None:
    proc = worker.proc
    if proc.stdout is None:
        raise DemoError("the demo worker has no stdout pipe")
    watchdog = threading.Timer(_WORKER_LIMIT_S, proc.kill)  # a hung worker ends the loop below (its pipe closes)
    watchdog.daemon = True
    watchdog.start()
    try:
        _read_events(proc, log, kill_at)
        proc.wait(_WORKER_LIMIT_S)
    finally:
        watchdog.cancel()
    log.seconds = time.perf_counter() - log.started
    with worker.stderr:
        if kill_at is None and proc.returncode != 0:
            worker.stderr.seek(0)
            err = worker.stderr.read()[-20000:]
            raise DemoError(f"the demo worker failed with exit code {proc.returncode}:\n{err}")


def _read_events(proc: subprocess.Popen[str], log: RunLog, kill_at: int | None) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        event = json.loads(line)
        kind = event["event"]
        if kind == "loss":
            log.losses[event["step"]] = event["loss"]
            if kill_at is not None and event["step"] >= kill_at:
                os.kill(proc.pid, signal.SIGKILL)
                log.killed_at = event["step"]
                break
        elif kind == "save":
            log.saves.append(event)
        elif kind == "restore":
            log.restore = event
        elif kind == "done":
            log.done = event


def main(
    argv: list[str] | None = None,
    *,
    steps: int = 300,
    save_every: int = 25,
    kill_at: int | None = None,
    directory: str | None = None,
    keep_last: int | None = None,
    out: Any = None,
) -> int:
    """Run the demo; returns 0 when the resumed run matches the reference bit for bit, else 1."""
    write = out if out is not None else (lambda s: print(s, flush=True))
    if kill_at is None:
        kill_at = int(steps * 0.57)
        if kill_at % save_every == 0:
            kill_at += save_every // 2
    if not 0 < kill_at < steps:
        raise ValueError(f"kill_at must be between 1 and steps-1 ({steps - 1}), got {kill_at}")
    work = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="tiersave-demo-"))
    ckpt = work / "checkpoints"
    if ckpt.exists() and any(ckpt.iterdir()):
        raise ValueError(f"{ckpt} is not empty; give the demo a new --dir")
    common = ["--steps", str(steps), "--save-every", str(save_every)]
    if keep_last:
        common += ["--keep-last", str(keep_last)]
    write(
        f"tiersave demo: training a small GPT for {steps} steps on the CPU, checkpointing every "
        f"{save_every} steps into {ckpt}"
    )
    write(f"  1. reference run (no checkpoints) and 2. checkpointed run, killed with SIGKILL after step {kill_at}")

    reference, crashed = RunLog(), RunLog()
    ref_proc = _worker(common)
    crash_proc = _worker([*common, "--ckpt", str(ckpt)])
    _follow(crash_proc, crashed, kill_at=kill_at)
    leftovers = sorted(p.name for p in ckpt.iterdir() if ".tmp-" in p.name) if ckpt.exists() else []
    # what is on disk, not the saves started: the kill may land before the newest one committed
    committed = Catalog(open_storage(str(ckpt), create=False)).steps() if ckpt.exists() else []
    write(
        f"     killed at step {crashed.killed_at}; committed checkpoints: "
        f"{', '.join(str(s) for s in committed) or 'none'}"
        + (f"; partial save left invisible: {', '.join(leftovers)}" if leftovers else "")
    )
    write("  3. resumed run: a new process restores the newest checkpoint and trains to the end")
    resumed = RunLog()
    res_proc = _worker([*common, "--ckpt", str(ckpt)])
    _follow(res_proc, resumed)
    _follow(ref_proc, reference)

    restored_step = resumed.restore["step"] if resumed.restore else 0
    compared = [s for s in resumed.losses]
    mismatches = [s for s in compared if resumed.losses[s] != reference.losses.get(s)]
    same_params = bool(resumed.done and reference.done and resumed.done["params"] == reference.done["params"])
    saves = crashed.saves + resumed.saves
    blocked = [s["blocked_s"] for s in saves]
    size = saves[-1]["bytes"] if saves else 0
    rows = [
        ["reference", f"1-{steps}", "-", f"{reference.seconds:.1f} s"],
        [
            "checkpointed",
            f"1-{crashed.killed_at}",
            f"{len(crashed.saves)} saved, then SIGKILL",
            f"{crashed.seconds:.1f} s",
        ],
        [
            "resumed",
            f"{restored_step + 1}-{steps}",
            f"restored step {restored_step}, {len(resumed.saves)} saved",
            f"{resumed.seconds:.1f} s",
        ],
    ]
    write("")
    write(table(["run", "steps", "checkpoints", "wall time"], rows))
    write("")
    if saves:
        write(
            f"checkpoint: {human_bytes(size)}, {saves[-1]['tensors']} tensors (model, AdamW state, LR schedule, "
            f"data position, RNG, step)"
        )
        write(
            f"time training was blocked per save: mean {1e3 * sum(blocked) / len(blocked):.1f} ms, "
            f"max {1e3 * max(blocked):.1f} ms over {len(blocked)} saves (save_async: the copy into staging "
            "memory; writing, fsync and commit run in the background)"
        )
    if resumed.restore:
        write(
            f"time to restore: {1e3 * resumed.restore['seconds']:.1f} ms "
            f"({human_bytes(resumed.restore['bytes'])} read and verified)"
        )
    ok = bool(compared) and not mismatches and same_params and restored_step > 0
    if ok:
        write(
            f"RESULT: resumed losses for steps {min(compared)}-{max(compared)} equal the reference run bit for bit "
            f"({len(compared)}/{len(compared)}), final weights identical."
        )
    else:
        write(
            f"RESULT: MISMATCH: {len(mismatches)} of {len(compared)} losses differ "
            f"(first at step {mismatches[0] if mismatches else '-'}); weights identical: {same_params}"
        )
    write(f"inspect the checkpoints: {_cli_command()} ls {ckpt}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())


def _cli_command() -> str:
    """How to run ``tiersave`` from here: its name when it is on PATH, else the path beside this Python
    (``.venv/bin/tiersave`` after ./scripts/setup.sh, until the virtual environment is activated)."""
    import shutil

    beside = Path(sys.executable).with_name("tiersave")
    on_path = shutil.which("tiersave")
    if on_path is not None and Path(on_path).resolve() == beside.resolve():
        return "tiersave"
    if beside.exists():
        return str(beside)
    return f"{sys.executable} -m tiersave.cli"
