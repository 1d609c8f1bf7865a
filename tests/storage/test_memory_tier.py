"""The memory tier (mem://, /dev/shm): a checkpoint saved there by a process that is then SIGKILLed is
restored by a new process; a save killed midway leaves a leftover that cleanup removes; retention keeps
/dev/shm to exactly the checkpoints kept, and nothing is left after the namespace is destroyed."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

import tiersave
from tiersave.catalog import Catalog
from tiersave.policy import parse_policy, plan_retention
from tiersave.storage.memory import MemoryStorage, namespaces


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"l{i}": torch.randn(256, 512, generator=g) for i in range(4)}, "step": step}


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state["model"]):
        h.update(state["model"][name].numpy().tobytes())
    h.update(str(state["step"]).encode())
    return h.hexdigest()


@pytest.fixture
def mem():
    storage = MemoryStorage(f"tier-{uuid.uuid4().hex[:12]}")
    yield storage
    storage.destroy()
    assert not storage.root.exists()
    assert storage.uri not in [n.uri for n in namespaces()]


def _fork_saver(uri: str, steps: list[int], crashpoint: str | None = None) -> tuple[int, list[int]]:
    """Fork a child that saves ``steps`` to ``uri``, reports each acknowledged step, then waits to be killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            torch.set_num_threads(1)  # libgomp is not fork-safe (see tests/reliability)
            if crashpoint:
                os.environ["TIERSAVE_CRASHPOINT"] = crashpoint
            with tiersave.Checkpointer(uri, io_threads=2) as ckpt:
                for step in steps:
                    ckpt.save(step, state_for(step)).result()
                    os.write(w, f"{step}\n".encode())
            os.write(w, b"idle\n")
            signal.pause()
        finally:
            os._exit(3)
    os.close(w)
    buf = b""
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            break  # the child died (crash point) before finishing
        buf += chunk
        if buf.endswith(b"idle\n"):
            break
    os.close(r)
    acked = [int(x) for x in buf.split() if x.isdigit()]
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return pid, acked


def test_checkpoint_survives_the_saving_process_and_a_new_process_restores_it(mem):
    _, acked = _fork_saver(mem.uri, [10, 20])
    assert acked == [10, 20]
    script = textwrap.dedent(
        f"""
        import hashlib, tiersave
        with tiersave.Checkpointer({mem.uri!r}) as ckpt:
            state = ckpt.restore()
            report = ckpt.last_restore
        h = hashlib.sha256()
        for name in sorted(state["model"]):
            h.update(state["model"][name].numpy().tobytes())
        h.update(str(state["step"]).encode())
        print(report.step, report.location, h.hexdigest())
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    step, location, restored = proc.stdout.split()
    assert int(step) == 20 and location == f"{mem.uri}/step-0000000020"
    assert restored == digest(state_for(20))


def test_save_killed_midway_leaves_a_leftover_that_cleanup_removes(mem):
    _, acked = _fork_saver(mem.uri, [1, 2], crashpoint="after_shard_fsync:2")
    assert acked == [1]  # killed while writing step 2
    catalog = Catalog(mem)
    assert catalog.steps() == [1]
    leftovers = catalog.leftovers()
    assert [status for _, status in leftovers] == ["dead"]  # its process is gone (same node)
    before = mem.used_bytes()
    assert catalog.clean_leftovers() == [leftovers[0][0]]
    assert catalog.leftovers() == []
    assert mem.used_bytes() < before
    assert mem.used_bytes() == sum(i.size for i in mem.list(""))
    with tiersave.Checkpointer(mem) as ckpt:
        assert ckpt.restore()["step"] == 1


def test_retention_frees_shared_memory(mem):
    with tiersave.Checkpointer(mem, keep_last=2) as ckpt:
        for step in range(1, 7):
            ckpt.save(step, state_for(step), metrics={"loss": 1.0 / step}).result()
    catalog = Catalog(mem)
    assert catalog.steps() == [5, 6]
    kept_bytes = sum(i.size for i in mem.list(""))
    assert mem.used_bytes() == kept_bytes
    one = catalog.info(6).stored_bytes
    assert one <= kept_bytes / 2 < one + (64 << 10)  # two checkpoints and their manifests, nothing else
    # A policy-driven prune: keep the best by loss (step 6 here) and protect step 5 (being read).
    plan = plan_retention(catalog.infos(), parse_policy("best=1:loss:min"), protected={5})
    assert plan.keep == (5, 6) and plan.delete == ()
    plan = plan_retention(catalog.infos(), parse_policy("last=1"))
    for step in plan.delete:
        catalog.delete(step)
    assert catalog.steps() == [6] and catalog.leftovers() == []
    assert mem.used_bytes() == sum(i.size for i in mem.list("")) <= one + (64 << 10)
