"""A plain PyTorch training loop with tiered, asynchronous checkpoints that resumes where it stopped.

Every save goes to RAM (``mem://``, survives a crash of this process); every 5th is copied to disk in the
background. Run it, interrupt it (Ctrl-C, ``--stop-at``, a kill), run the same command again: it resumes from
the newest checkpoint, model, optimizer, scheduler, data position and RNG included.

    python examples/train_loop.py --dir /tmp/run1 --stop-at 120   # "preempted" after step 120
    python examples/train_loop.py --dir /tmp/run1                  # resumes at the newest checkpoint
    tiersave ls /tmp/run1/ckpt                                     # what the disk tier holds
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
from _common import Batches, Classifier, dataset

import tiersave
from tiersave import Tier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="run directory (the disk tier is DIR/ckpt)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--stop-at", type=int, default=None, help="stop after this step, as a preemption would")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Classifier()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    batches = Batches(dataset(2048))
    state = {"model": model, "optim": optim, "sched": sched, "data": batches, "rng": tiersave.RNGState(), "step": 0}

    disk = os.path.join(os.path.abspath(args.dir), "ckpt")
    ram = "mem://run-" + hashlib.sha1(disk.encode()).hexdigest()[:12]  # one RAM namespace per run directory
    with tiersave.Checkpointer(tiers=[Tier(ram, keep=2), Tier(disk, every=5, keep=3)]) as ckpt:
        if ckpt.latest() is not None:
            ckpt.restore(into=state)  # reads straight into the live tensors; the fastest tier first
            report = ckpt.last_restore
            print(f"resuming from step {state['step']} (read {report.bytes_read} bytes from tier {report.tier})")
        loss = torch.tensor(0.0)
        for step in range(state["step"] + 1, args.steps + 1):
            x, y = batches.next()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            sched.step()
            state["step"] = step
            if step % args.save_every == 0:
                # Returns once the tensors are staged; writing and committing go on in the background.
                ckpt.save_async(step, state, metrics={"loss": loss.item()})
            if step == args.stop_at:
                break
        ckpt.wait()  # the last save and its copy to disk (close() waits too)
        held = {tier: [i.step for i in ckpt.list() if tier in i.tiers] for tier in ckpt.tiers}
        print(f"stopped at step {state['step']}, loss {loss.item():.4f}; checkpoints held: {held}")


if __name__ == "__main__":
    main()
