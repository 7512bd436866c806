"""Tiny self-contained PyTorch Lightning run that resumes where rlsup tells it to (CPU, seconds).

    rlsup run --checkpoint-dir ckpts -- python examples/lightning_train.py

rlsup picks the newest *complete* ``.ckpt`` under ``ckpts`` before each attempt (a named
``epoch=E-step=S.ckpt`` is preferred over ``last.ckpt``; torn or half-linked saves are skipped) and
passes it as ``RLSUP_RESUME_DIR`` (empty on a fresh start). The one line a Lightning script adds is
the ``ckpt_path=`` argument below; ``ModelCheckpoint(dirpath=...)`` must write into the directory
given to ``--checkpoint-dir`` (rlsup also exports it as ``RLSUP_CHECKPOINT_DIR``).

Resume is exact when checkpoints fall on epoch boundaries (here: 8 batches per epoch, a checkpoint
every 8 steps) with seeded data order; Lightning replays a half-done epoch from its start.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    L.seed_everything(0)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen))
    dirpath = os.environ.get("RLSUP_CHECKPOINT_DIR") or "ckpts"
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=8, save_top_k=-1, save_last="link")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=64, logger=False, enable_progress_bar=False,
                        callbacks=[checkpoint], deterministic=True)
    trainer.fit(Tiny(), DataLoader(data, batch_size=4),
                ckpt_path=os.environ.get("RLSUP_RESUME_DIR") or None)  # the line rlsup needs
    print(f"finished at step {trainer.global_step}")


if __name__ == "__main__":
    main()
