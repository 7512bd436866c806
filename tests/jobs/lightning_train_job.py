"""A tiny deterministic Lightning run (CPU) for rlsup's tests: the real ModelCheckpoint writer.

Resumes through Lightning's own mechanism from the checkpoint rlsup chose (``RLSUP_RESUME_DIR``, a
``.ckpt`` path; empty on a fresh start). Appends one line per attempt to ``--log``
(``start <pid> <resume step or -1> [<resume path>]`` and ``done <global_step>``) and saves the final weights to ``--out``.
``--slow S`` sleeps S seconds per training step so a test can kill it at chosen moments.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    """Linear regression: a few hundred bytes of weights, so every save is cheap."""

    def __init__(self, slow: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.slow = slow

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.slow:
            time.sleep(self.slow)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dirpath", required=True)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--save-last", choices=("link", "copy", "none"), default="link")
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--out", default="")
    p.add_argument("--log", default="")
    p.add_argument("--resume", default=None, help="ckpt_path for fit (default: $RLSUP_RESUME_DIR)")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    L.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen))
    loader = DataLoader(data, batch_size=4, shuffle=False)  # 8 batches per epoch
    save_last = {"link": "link", "copy": True, "none": False}[a.save_last]
    ckpt = ModelCheckpoint(dirpath=a.dirpath, every_n_train_steps=a.every, save_last=save_last, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=a.max_steps, enable_progress_bar=False,
                        logger=False, enable_model_summary=False, callbacks=[ckpt], deterministic=True)
    resume = a.resume if a.resume is not None else os.environ.get("RLSUP_RESUME_DIR", "")
    if a.log:
        with open(a.log, "a") as fh:
            step = os.environ.get("RLSUP_RESUME_STEP", "-1") if resume else "-1"
            fh.write(f"start {os.getpid()} {step} {resume}".rstrip() + "\n")
    trainer.fit(Tiny(a.slow), loader, ckpt_path=resume or None)
    if a.out:
        torch.save({k: v.clone() for k, v in trainer.lightning_module.state_dict().items()}, a.out)
    if a.log:
        with open(a.log, "a") as fh:
            fh.write(f"done {trainer.global_step}\n")


if __name__ == "__main__":
    main()
