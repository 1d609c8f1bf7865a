"""An inference process that follows training: each newly committed checkpoint is loaded into a serving model
while training goes on.

``tiersave.watch(root)`` yields each checkpoint as it is committed (never a partial one), oldest first;
``restore(step, into={"model": model})`` reads only the model's tensors of it (not the optimizer's), verified.
A checkpoint the trainer's retention deleted before this process got to it is skipped. With ``--tag serving``
it serves only the checkpoint that the movable tag points to, and each one it is moved to
(``tiersave tag DIR/ckpt STEP serving``, or ``ckpt.tag(step, "serving")`` in training).

    python examples/serve_watch.py --dir /tmp/run1 --timeout 60 &     # waits for checkpoints
    python examples/train_loop.py --dir /tmp/run1                     # the trainer writes them
"""

from __future__ import annotations

import argparse
import os

import torch
from _common import Classifier, dataset

import tiersave


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="the trainer's run directory (checkpoints in DIR/ckpt)")
    parser.add_argument("--timeout", type=float, default=60.0, help="stop after this many seconds with nothing new")
    parser.add_argument("--until", type=int, default=None, help="stop after serving this step (or a later one)")
    parser.add_argument("--tag", default=None, help="follow this movable tag instead of every new checkpoint")
    args = parser.parse_args()

    root = os.path.join(args.dir, "ckpt")
    os.makedirs(root, exist_ok=True)
    model = Classifier().eval()
    queries = dataset(512, seed=9)
    reader = tiersave.Checkpointer(root)  # reads only: it never saves, so it deletes nothing
    print(f"watching {root}", flush=True)
    for info in tiersave.watch(root, include_existing=True, poll_s=0.2, timeout_s=args.timeout, tag=args.tag):
        try:
            reader.restore(info.step, into={"model": model})
        except tiersave.CheckpointNotFoundError:
            print(f"step {info.step} was deleted before it could be read; waiting for the next", flush=True)
            continue
        with torch.no_grad():
            accuracy = float((model(queries[0]).argmax(1) == queries[1]).float().mean())
        report = reader.last_restore
        print(f"serving step {info.step}: accuracy {accuracy:.2f} ({report.bytes_read} bytes read)", flush=True)
        if args.until is not None and info.step >= args.until:
            break
    reader.close()


if __name__ == "__main__":
    main()
