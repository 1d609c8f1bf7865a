"""kill -9 at random instants over every tier: local disk, ``mem://``, the ``[mem, local]`` chain and S3 (the
real SeaweedFS server), with synchronous and asynchronous saves. A saver saves steps in a loop (retention
keeps 2 on every tier, so kills also land in retention and, on the chain, in the drain to the second
tier); after each kill, every restore must be of a committed checkpoint, bit-exact, never torn, at or
after the last acknowledged step, and the last acknowledged checkpoint must still restore.

Each test prints one line: trials, kills that landed inside a save, violations (asserted to be 0), and the
seed (replay the same kill instants with TIERSAVE_CRASH_SEED=...). ``--long`` runs ten times the trials.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
from saver_zygote import state_for as saver_state

import tiersave
from helpers import S3_TEST_OPTIONS, assert_same

NUMEL = 64 * 1024  # 4 tensors of 256 KiB


def state_for(step: int) -> dict:
    return saver_state(step, NUMEL)  # what the saver saved for this step


class Variant:
    """The tiers of one variant: their spec for the saver, and storages to check them from this process."""

    def __init__(self, kinds: list[str], tmp: Path) -> None:
        self.kinds = kinds
        self.specs: list[dict[str, Any]] = []
        self.cleanup: list[Path] = []
        for kind in kinds:
            if kind == "local":
                (tmp / "local").mkdir()
                self.specs.append({"kind": "local", "uri": str(tmp / "local")})
            elif kind == "mem":
                from tiersave.storage.memory import MemoryStorage

                name = f"figures-{uuid.uuid4().hex[:10]}"
                self.cleanup.append(Path(MemoryStorage(name).root))
                self.specs.append({"kind": "mem", "uri": f"mem://{name}"})
            else:
                from tiersave.testing.seaweed import SeaweedServer

                server = SeaweedServer.shared()
                bucket = f"ts-{uuid.uuid4().hex[:20]}"
                server.storage(bucket, "kill").close()  # creates the bucket
                uri = server.uri(bucket, "kill", **S3_TEST_OPTIONS)
                self.specs.append({"kind": "s3", "uri": uri, "ak": server.access_key, "sk": server.secret_key})

    def tier(self, spec: dict[str, Any]) -> tiersave.Tier:
        if spec["kind"] == "s3":
            from tiersave.storage.s3 import S3Storage

            storage = S3Storage.from_uri(spec["uri"], env={}, access_key_id=spec["ak"], secret_access_key=spec["sk"])
            return tiersave.Tier(storage, name="s3", keep=2)
        return tiersave.Tier(spec["uri"], name=spec["kind"], keep=2)

    def open(self, only: dict[str, Any] | None = None) -> tiersave.Checkpointer:
        specs = [only] if only is not None else self.specs
        return tiersave.Checkpointer(tiers=[self.tier(s) for s in specs], event_log=False)

    def close(self) -> None:
        for path in self.cleanup:
            shutil.rmtree(path, ignore_errors=True)


def check(variant: Variant, acked: list[int]) -> tuple[int, list[str]]:
    """The invariant after one kill; returns (the newest step on any tier, violations)."""
    found: list[str] = []
    newest = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for spec in variant.specs:  # each tier alone: what it lists is committed and whole
            with variant.open(spec) as ckpt:
                steps = ckpt.catalog.steps()
                if not steps:
                    continue
                newest = max(newest, steps[-1])
                try:
                    restored = ckpt.restore()
                    if ckpt.last_restore.step != steps[-1] or ckpt.last_restore.skipped:
                        found.append(f"{spec['kind']}: newest step {steps[-1]} did not restore")
                    assert_same(restored, state_for(ckpt.last_restore.step))
                except (tiersave.TiersaveError, AssertionError) as exc:
                    found.append(f"{spec['kind']}: restoring the newest of {steps}: {type(exc).__name__}: {exc}")
        if acked:
            with variant.open() as ckpt:
                try:
                    restored = ckpt.restore()
                    if ckpt.last_restore.step < acked[-1]:
                        found.append(f"acknowledged step {acked[-1]} lost: restored {ckpt.last_restore.step}")
                    assert_same(restored, state_for(ckpt.last_restore.step))
                    assert_same(ckpt.restore(acked[-1]), state_for(acked[-1]))  # the previous one still restores
                except (tiersave.TiersaveError, AssertionError) as exc:
                    found.append(f"after acknowledged {acked}: {type(exc).__name__}: {exc}")
    found += [f"warning: {w.message}" for w in caught if issubclass(w.category, tiersave.TiersaveWarning)]
    return newest, found


def run_trials(zygote, variant: Variant, mode: str, trials: int, seed: int, window: tuple[float, float], tmp: Path):
    rng = random.Random(seed)
    next_step, inside, acks, violations = 1, 0, 0, []
    for trial in range(trials):
        log = tmp / f"log-{trial}"
        spec = {"tiers": variant.specs, "first": next_step, "log": str(log), "mode": mode, "numel": NUMEL}
        pid = zygote.fork(spec)
        time.sleep(rng.uniform(*window))
        os.kill(pid, signal.SIGKILL)
        status = zygote.reap(pid)
        lines = log.read_text().split() if log.exists() else []
        events = list(zip(lines[::2], map(int, lines[1::2])))
        acked = [step for what, step in events if what == "ack"]
        acks += len(acked)
        inside += bool(events) and events[-1][0] == "begin"
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            violations.append(f"trial {trial}: the saver stopped by itself (status {status}) before the kill")
        newest, found = check(variant, acked)
        violations += [f"trial {trial} (first step {next_step}): {v}" for v in found]
        next_step = max([next_step, newest, *acked]) + 1
    return inside, acks, violations, next_step


def leftovers(variant: Variant, status: str | None = None) -> dict[str, int]:
    out = {}
    for spec in variant.specs:
        with variant.open(spec) as ckpt:
            out[spec["kind"]] = sum(status in (None, s) for _, s in ckpt.catalog.leftovers())
    return out


def save_to_the_end(variant: Variant, step: int) -> None:
    """One save that finishes, drains included (close waits for them): the killed savers' leftovers go."""
    with variant.open() as ckpt:
        ckpt.save(step, state_for(step))


# (tiers, default trials per mode, kill window in seconds)
VARIANTS = {
    "local": (["local"], 12, (0.02, 0.3)),
    "mem": (["mem"], 20, (0.01, 0.15)),
    "mem+local": (["mem", "local"], 12, (0.02, 0.35)),
    "s3": (["s3"], 6, (0.05, 1.0)),
}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_random_kill9_over_every_tier(zygote, tmp_path, crash_seed, long_run, name, mode):
    kinds, trials, window = VARIANTS[name]
    trials *= 10 if long_run else 1
    variant = Variant(kinds, tmp_path)
    try:
        inside, acks, violations, next_step = run_trials(zygote, variant, mode, trials, crash_seed, window, tmp_path)
        left = leftovers(variant)
        save_to_the_end(variant, next_step)
        dead_after = leftovers(variant, "dead")
    finally:
        variant.close()
    print(
        f"kill -9 {name} {mode}: trials={trials} kills_inside_a_save={inside} acknowledged={acks} "
        f"violations={len(violations)} "
        f"leftovers={left} dead_leftovers_after_a_whole_save={dead_after} seed={crash_seed}"
    )
    assert not violations, "\n".join(violations[:10])
    assert acks > 0, "no save was ever acknowledged: the savers never got to save"
    assert inside > 0, "no kill landed inside a save: the test did not exercise what it names"
    assert not any(dead_after.values()), f"a whole save left the killed savers' leftovers behind: {dead_after}"
