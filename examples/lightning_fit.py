"""Lightning with tiersave checkpoints: ModelCheckpoint keeps the best epoch by val_loss and last.ckpt, each
written asynchronously through tiersave; run it again and ``fit(ckpt_path="last")`` resumes exactly.

    python examples/lightning_fit.py --dir /tmp/pl-run --epochs 2   # stop after 2 epochs
    python examples/lightning_fit.py --dir /tmp/pl-run --epochs 5   # resumes at epoch 2
    tiersave ls /tmp/pl-run/tiersave                                 # the steps the .ckpt pointers name

Needs ``pip install 'tiersave[lightning]'``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tiersave.integrations.lightning import TiersaveCheckpointIO


class Regressor(L.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()  # plain values: stored pickle-free
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, _idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)}


def loaders() -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 16, generator=g)
    y = torch.sin(x).sum(dim=1, keepdim=True)
    train = torch.utils.data.TensorDataset(x[:512], y[:512])
    val = torch.utils.data.TensorDataset(x[512:], y[512:])
    return (
        torch.utils.data.DataLoader(train, batch_size=32, shuffle=True),
        torch.utils.data.DataLoader(val, batch_size=32),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="run directory")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    L.seed_everything(0)
    io = TiersaveCheckpointIO(os.path.join(args.dir, "tiersave"))  # or a tiersave.Checkpointer(tiers=[...])
    best = ModelCheckpoint(os.path.join(args.dir, "ckpt"), monitor="val_loss", save_top_k=1, save_last=True)
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        plugins=[io],
        callbacks=[best],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    train, val = loaders()
    trainer.fit(Regressor(), train, val, ckpt_path="last")  # no last.ckpt yet: starts fresh
    steps = ", ".join(str(c.step) for c in io.checkpointer.list())
    print(
        f"epoch {trainer.current_epoch}, step {trainer.global_step}; best {best.best_model_path} "
        f"(val_loss {float(best.best_model_score):.4f}); stored steps: {steps}"
    )
    io.close()


if __name__ == "__main__":
    main()
