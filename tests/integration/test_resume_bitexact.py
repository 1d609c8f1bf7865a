"""Bit-exact resume: a fresh process restoring step N and training to M matches an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import tiersave
from helpers import assert_same

SMALL = ["--dim", "32", "--layers", "1"]


def run_worker(*args: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "tiersave.demo.train", *SMALL, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


def losses(events: list[dict]) -> dict[int, str]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "loss"}


def test_fresh_process_resumes_bit_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    reference = run_worker("--steps", "40")
    first = run_worker("--steps", "40", "--save-every", "20", "--stop-after", "20", "--ckpt", ckpt)
    resumed = run_worker("--steps", "40", "--save-every", "20", "--ckpt", ckpt)

    assert max(losses(first)) == 20
    (restore,) = [e for e in resumed if e["event"] == "restore"]
    assert restore["step"] == 20
    ref_losses, res_losses = losses(reference), losses(resumed)
    assert sorted(res_losses) == list(range(21, 41))
    assert all(res_losses[s] == ref_losses[s] for s in res_losses), "a resumed loss differs from the reference"
    ref_done, res_done = reference[-1], resumed[-1]
    assert ref_done["params"] == res_done["params"]  # weights bit-identical
    assert ref_done["optim"] == res_done["optim"]  # AdamW moments and step counts bit-identical
    assert ref_done["lr"] == res_done["lr"]  # LR schedule position


def test_in_process_resume_matches_parameters_and_optimizer(tmp_path):
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.ExponentialLR(optim, 0.9)
        return model, optim, sched

    def train(model, optim, sched, steps, data_gen):
        out = []
        for _ in range(steps):
            x = torch.randn(8, 16, generator=data_gen)
            loss = model(x).square().mean()  # dropout draws from the global RNG
            optim.zero_grad()
            loss.backward()
            optim.step()
            sched.step()
            out.append(loss.item())
        return out

    model, optim, sched = make()
    data_gen = torch.Generator().manual_seed(1)
    state = {"model": model, "optim": optim, "sched": sched, "rng": tiersave.RNGState(generators={"data": data_gen})}
    train(model, optim, sched, 5, data_gen)
    with tiersave.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(5, state)
        after = train(model, optim, sched, 7, data_gen)

        model2, optim2, sched2 = make()
        data_gen2 = torch.Generator().manual_seed(999)
        torch.manual_seed(12345)  # scramble the global RNG: the checkpoint must restore it
        state2 = {
            "model": model2,
            "optim": optim2,
            "sched": sched2,
            "rng": tiersave.RNGState(generators={"data": data_gen2}),
        }
        ckpt.restore(5, into=state2)
        again = train(model2, optim2, sched2, 7, data_gen2)
    assert again == after
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(optim.state_dict(), optim2.state_dict())
    assert sched.state_dict() == sched2.state_dict()
