"""Launching real multi-process jobs (gloo on 127.0.0.1) for the tests in tests/dist.

Every launch bounds its own time: the processes get a deadline, whatever is still running then is killed
(SIGKILL, by process id) in a ``finally``, and the test fails with the ranks' logs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "src"
WORKERS = HERE / "workers.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Job:
    """What a launched job left: each rank's record (missing for ranks that died) and the exit codes."""

    records: dict[int, dict[str, Any]]
    returncodes: list[int | None]
    logs: str

    def rank(self, r: int) -> dict[str, Any]:
        assert r in self.records, f"rank {r} wrote no record; exit codes {self.returncodes}\n{self.logs}"
        return self.records[r]


def _env(out: Path, extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE), env.get("PYTHONPATH", "")]),
            "TIERSAVE_DIST_OUT": str(out),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra)
    return env


def _run(commands: Sequence[tuple[list[str], dict[str, str]]], out: Path, deadline_s: float) -> Job:
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for i, (argv, env) in enumerate(commands):
            log = out / f"proc{i}.log"
            logs.append(log)
            with open(log, "wb") as sink:
                # Own session: the process (and a torchrun agent's workers) can be killed as one group.
                procs.append(
                    subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
                )
        end = time.monotonic() + deadline_s
        for proc in procs:
            try:
                proc.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
    finally:
        _stop([p for p in procs if p.poll() is None])
    text = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in logs if p.exists())
    records = {}
    for path in out.glob("rank*.json"):
        record = json.loads(path.read_text())
        records[int(record["rank"])] = record
    return Job(records, [p.returncode for p in procs], text)


class Running:
    """A job started in the background (``launch(..., background=True)``): kill ranks, then ``finish``."""

    def __init__(self, commands: Sequence[tuple[list[str], dict[str, str]]], out: Path) -> None:
        self.out = out
        self.procs: list[subprocess.Popen[bytes]] = []
        for i, (argv, env) in enumerate(commands):
            with open(out / f"proc{i}.log", "wb") as sink:
                self.procs.append(
                    subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
                )

    def kill(self, index: int) -> None:
        try:
            os.killpg(self.procs[index].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def finish(self, deadline_s: float) -> list[int | None]:
        """Wait up to ``deadline_s`` for the ranks to end, kill what is left; the exit codes."""
        end = time.monotonic() + deadline_s
        try:
            for proc in self.procs:
                try:
                    proc.wait(timeout=max(end - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    break
        finally:
            _stop([p for p in self.procs if p.poll() is None])
        return [p.returncode for p in self.procs]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Leftovers: SIGTERM first (a torchrun agent then stops its workers), SIGKILL to the group after 5 s."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    end = time.monotonic() + 5
    for proc in procs:
        try:
            proc.wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def launch(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Job]:
    """``launch(scenario, world, env=..., deadline_s=...)``: one ``python workers.py`` process per rank."""

    def run(
        scenario: str,
        world: int,
        *,
        env: dict[str, str] | None = None,
        deadline_s: float = 60,
        script: Path = WORKERS,
        rank_env: dict[int, dict[str, str]] | None = None,
        background: bool = False,
    ) -> Job | Running:
        out = tmp_path_factory.mktemp(scenario)
        port = str(free_port())
        commands = []
        for rank in range(world):
            extra = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank),
                **(env or {}),
                **((rank_env or {}).get(rank, {})),
            }
            commands.append(([sys.executable, str(script), scenario], _env(out, extra)))
        if background:
            return Running(commands, out)
        return _run(commands, out, deadline_s)

    return run


@pytest.fixture(scope="session")
def launch_torchrun(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Job]:
    """``launch_torchrun(scenario, nnodes, nproc_per_node)``: one torchrun agent per simulated node, all on
    127.0.0.1 (``--nnodes N --node-rank i --master-addr 127.0.0.1``), workers running ``workers.py``."""

    def run(
        scenario: str,
        nnodes: int,
        nproc_per_node: int,
        *,
        deadline_s: float = 90,
        script: Path = WORKERS,
        env: dict[str, str] | None = None,
    ) -> Job:
        out = tmp_path_factory.mktemp(f"{scenario}-torchrun")
        port = str(free_port())
        commands = []
        for node in range(nnodes):
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nnodes}",
                f"--nproc-per-node={nproc_per_node}",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                str(script),
                scenario,
            ]
            commands.append((argv, _env(out, env or {})))
        return _run(commands, out, deadline_s)

    return run
