"""Hugging Face Trainer with tiersave checkpoints: train a tiny GPT-2 (built from a config, no download) on
generated tokens; run it again and it resumes from the newest checkpoint, exactly.

    python examples/hf_trainer.py --dir /tmp/hf-run --stop-at 10   # "preempted" after step 10
    python examples/hf_trainer.py --dir /tmp/hf-run                # resumes at step 10, trains to the end
    tiersave ls /tmp/hf-run/ckpt                                   # the last 2 and the best by eval_loss

Needs ``pip install 'tiersave[hf]'``.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from tiersave.integrations.hf import TiersaveTrainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int, vocab: int = 128, seq: int = 32) -> None:
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step >= self.step:
            control.should_training_stop = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="run directory (checkpoints in DIR/ckpt)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--stop-at", type=int, default=None, help="stop after this step, as a preemption would")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=os.path.join(args.dir, "out"),
        num_train_epochs=args.epochs,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=5,
        save_steps=5,
        save_total_limit=2,  # with metric_for_best_model: the last 2 and the best are kept
        metric_for_best_model="eval_loss",
        load_best_model_at_end=True,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = TiersaveTrainer(
        model=model,
        args=training,
        train_dataset=Tokens(160, seed=1),
        eval_dataset=Tokens(32, seed=2),
        callbacks=[StopAt(args.stop_at)] if args.stop_at else [],
        checkpointer=os.path.join(args.dir, "ckpt"),  # or tiersave.Checkpointer(tiers=[...])
    )
    latest = trainer.checkpointer.latest()
    if latest is not None:
        print(f"resuming from step {latest.step}")
    trainer.train(resume_from_checkpoint=latest is not None)
    kept = ", ".join(f"{c.step}{' (best)' if 'best' in c.tags else ''}" for c in trainer.checkpointer.list())
    print(
        f"stopped at step {trainer.state.global_step}; best eval_loss {trainer.state.best_metric:.4f} "
        f"at step {trainer.state.best_global_step}; checkpoints kept: {kept}"
    )
    trainer.checkpointer.close()


if __name__ == "__main__":
    main()
