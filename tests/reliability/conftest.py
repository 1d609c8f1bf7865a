"""Fixtures of the reliability figures: the replayable crash seed and the saver fork server."""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def crash_seed(request: pytest.FixtureRequest) -> int:
    """The seed of a figures test (kill instants, fault choices), printed; replay with TIERSAVE_CRASH_SEED."""
    value = int(os.environ.get("TIERSAVE_CRASH_SEED", random.randrange(1 << 30)))
    print(f"\n[{request.node.name}] seed={value} (replay: TIERSAVE_CRASH_SEED={value})")
    return value


class Zygote:
    """The test's side of tests/reliability/saver_zygote.py; every wait is bounded."""

    def __init__(self, timeout_s: float = 120.0) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("saver_zygote.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buf = b""
        self._ask(None, timeout_s)  # wait until torch and tiersave are imported

    def _ask(self, request: dict[str, Any] | None, timeout_s: float = 30.0) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if request is not None:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise RuntimeError(f"the saver fork server did not answer {request} within {timeout_s} s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError("the saver fork server exited")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)  # type: ignore[no-any-return]

    def fork(self, spec: dict[str, Any]) -> int:
        return int(self._ask({"op": "fork", "spec": spec})["pid"])

    def reap(self, pid: int) -> int:
        return int(self._ask({"op": "reap", "pid": pid})["status"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def zygote():
    """A saver fork server shared by a module's kill tests."""
    server = Zygote()
    yield server
    server.close()
