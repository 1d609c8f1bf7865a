"""Many ranks, one checkpoint per step: a DistributedDataParallel job (CPU, gloo) launched by torchrun.

With ``torch.distributed`` initialized, ``tiersave.Checkpointer`` is collective: every rank saves its own state
(model, optimizer, its data position, its RNG) into one checkpoint, rank 0 commits it once every rank's part is
durable, and on restart every rank restores its own part. Run it again after an interruption and all ranks
resume from the same step.

    torchrun --nproc-per-node 2 examples/torchrun_job.py --dir /tmp/ddp --stop-at 30
    torchrun --nproc-per-node 2 examples/torchrun_job.py --dir /tmp/ddp      # resumes at step 30
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from _common import Batches, Classifier, dataset
from torch.nn.parallel import DistributedDataParallel

import tiersave


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="run directory (checkpoints in DIR/ckpt)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--stop-at", type=int, default=None, help="stop after this step, as a preemption would")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(Classifier())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = Batches(dataset(1024, seed=100 + rank))  # each rank its own data
    state = {"model": model.module, "optim": optim, "data": batches, "rng": tiersave.RNGState(), "step": 0}

    # Collective because torch.distributed is initialized: every rank creates it, saves and restores.
    with tiersave.Checkpointer(os.path.join(args.dir, "ckpt"), keep_last=2) as ckpt:
        if ckpt.latest() is not None:
            ckpt.restore(into=state)
            print(f"rank {rank}: resuming from step {state['step']} (data position {batches.position})")
        loss = torch.tensor(0.0)
        for step in range(state["step"] + 1, args.steps + 1):
            x, y = batches.next()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optim.zero_grad()
            loss.backward()  # DDP averages the gradients across ranks
            optim.step()
            state["step"] = step
            if step % args.save_every == 0:
                ckpt.save_async(step, state, metrics={"loss": loss.item()})
            if step == args.stop_at:
                break
        ckpt.wait()
        info = ckpt.latest()
        if rank == 0 and info is not None:
            newest = f"step {info.step}, saved by {info.world_size} ranks"
            print(f"stopped at step {state['step']}; newest checkpoint: {newest}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
