"""A fork server for the kill -9 figures: started once (a fresh interpreter, torch imported), it forks a saver
per request, so a trial costs a fork, not an interpreter start.

Why a separate interpreter: the S3 tier's client (obstore) runs a Rust runtime whose threads do not survive
``fork``; the test process may have started one already, this process never does before forking.

Protocol, one JSON object a line on stdin, one answer a line on stdout:
  {"op": "fork", "spec": {...}}  -> {"pid": N}   (the child saves steps forever, logging to spec["log"])
  {"op": "reap", "pid": N}       -> {"status": S} (after the test killed it)
The child writes ``begin N`` before each save and ``ack N`` once it is acknowledged (``save`` returned, or
the handle's ``result()`` for an asynchronous save).
"""

from __future__ import annotations

import json
import os
import sys

import torch

import tiersave
import tiersave.checkpointer
import tiersave.drain
import tiersave.restore
import tiersave.saving
import tiersave.storage.memory
import tiersave.storage.posix
from tiersave.storage.s3 import S3Storage


def state_for(step: int, numel: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {f"layer{i}": torch.randn(numel, generator=g) for i in range(4)},
        "small": torch.randn(3, generator=g),
        "step": step,
        "lr": 1e-3 * step,
    }


def build(spec: dict) -> tiersave.Checkpointer:
    tiers: list = []
    for t in spec["tiers"]:
        if t["kind"] == "s3":
            storage = S3Storage.from_uri(t["uri"], env={}, access_key_id=t["ak"], secret_access_key=t["sk"])
            tiers.append(tiersave.Tier(storage, name="s3", keep=2))
        else:
            tiers.append(tiersave.Tier(t["uri"], name=t["kind"], keep=2))
    return tiersave.Checkpointer(tiers=tiers, io_threads=2, event_log=False)


def child(spec: dict) -> None:
    log = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with build(spec) as ckpt:
        step = spec["first"]
        while True:
            state = state_for(step, spec["numel"])
            os.write(log, f"begin {step}\n".encode())
            if spec["mode"] == "async":
                handle = ckpt.save_async(step, state)
                # the caller changes its state in place as soon as save_async returns: the snapshot must hold
                for tensor in state["model"].values():
                    tensor.add_(1.0)
                handle.result()
            else:
                ckpt.save(step, state)
            os.write(log, f"ack {step}\n".encode())
            step += 1


def main() -> None:
    # libgomp is not fork-safe: keep torch out of OpenMP so the forked children never deadlock in it.
    torch.set_num_threads(1)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                code = 3
                try:
                    child(req["spec"])
                except BaseException as exc:  # a saver that stops by itself is a failure the test reports
                    print(f"saver stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                    code = 4
                finally:
                    os._exit(code)
            print(json.dumps({"pid": pid}), flush=True)
        elif req["op"] == "reap":
            _, status = os.waitpid(req["pid"], 0)
            print(json.dumps({"status": status}), flush=True)


if __name__ == "__main__":
    main()
