"""Capture real trainer output for tests/diagnosis/test_progress.py: the bytes a job writes to rlsup's pipe
(stdout and stderr on one pipe, as rlsup runs jobs: no terminal, so tqdm writes every redraw with ``\\r``).

    .venv/bin/python tests/data/progress/capture.py   # rewrites the *.out files next to this script

Each run is tiny, seeded and on CPU (nothing downloaded):
- hf_trainer.out: transformers' Trainer (a 2-layer LLaMA from a config), a datasets ``map`` and ``filter``,
  14 steps with an evaluation and a save every 6 steps (so shard writing and the evaluation bar appear
  while the training bar runs); a callback sleeps 0.12 s per step so tqdm (mininterval 0.1 s) draws
  every step, as it does for real step times.
- lightning_fit.out, lightning_resume_mid_epoch.out, lightning_resume_epoch_end.out: PyTorch Lightning
  with its TQDMProgressBar (8 batches an epoch, validation every 6 batches, a checkpoint every 4 steps),
  12 steps fresh, then 20 steps resumed from step 4 (mid-epoch) and from step 8 (an epoch's end).
- nanogpt_train.out: karpathy/nanoGPT's train.py (tests/thirdparty/nanogpt, unmodified) on generated
  text, 15 iterations, an evaluation and a save at iteration 10, ``PYTHONUNBUFFERED=1`` (nanoGPT prints
  with ``print``: block-buffered into a pipe otherwise).
The versions used are written to versions.txt.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

HF = r'''
import sys, time
import torch
from datasets import Dataset
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments)

class Slow(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.12)

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False))
rows = torch.randint(1, 64, (96, 16), generator=torch.Generator().manual_seed(1)).tolist()
ds = Dataset.from_dict({"ids": rows}).map(lambda r: {"input_ids": r["ids"], "labels": r["ids"]}, remove_columns=["ids"])
train, ev = ds.select(range(64)), ds.select(range(64, 96)).filter(lambda r: len(r["input_ids"]) == 16)
args = TrainingArguments(output_dir=sys.argv[1], max_steps=14, save_steps=6, eval_strategy="steps", eval_steps=6,
                         per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=1e-3,
                         use_cpu=True, report_to=[], logging_steps=6, seed=0, disable_tqdm=False)
Trainer(model=model, args=args, train_dataset=train, eval_dataset=ev, callbacks=[Slow()]).train()
print("training done", flush=True)
'''

LIGHTNING = r'''
import sys
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

L.seed_everything(0)
gen = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen))
out = sys.argv[1]
trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=int(sys.argv[2]), logger=CSVLogger(out + "/logs"),
                    callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=4, save_top_k=-1), TQDMProgressBar()],
                    val_check_interval=6, num_sanity_val_steps=2)
trainer.fit(Tiny(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=8),
            ckpt_path=sys.argv[3] if len(sys.argv) > 3 else None)
print(f"finished at step {trainer.global_step}", flush=True)
'''


def _run(argv: list[str], out: str, cwd: Path, **env: str) -> None:
    with open(HERE / out, "wb") as f:
        subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, check=True,
                       env={**os.environ, "PYTHONWARNINGS": "ignore", **env})


def main() -> None:
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _run([py, "-c", HF, str(work / "hf")], "hf_trainer.out", work)
        _run([py, "-c", LIGHTNING, str(work / "pl"), "12"], "lightning_fit.out", work)
        for step, name in ((4, "mid_epoch"), (8, "epoch_end")):
            ckpt = next((work / "pl").glob(f"epoch=*-step={step}.ckpt"))
            _run([py, "-c", LIGHTNING, str(work / f"pl{step}"), "20", str(ckpt)], f"lightning_resume_{name}.out", work)
        sys.path.insert(0, str(ROOT / "tests" / "thirdparty"))
        from setup_trainers import nanogpt_workdir

        ng = nanogpt_workdir(work / "nanogpt")
        _run([py, "train.py", "--dataset=tiny", "--device=cpu", "--compile=False", "--dtype=float32", "--n_layer=2",
              "--n_head=4", "--n_embd=64", "--block_size=64", "--batch_size=8", "--max_iters=14",
              "--eval_interval=10", "--eval_iters=2", "--log_interval=1", "--always_save_checkpoint=True",
              "--out_dir=out"], "nanogpt_train.out", ng, PYTHONUNBUFFERED="1")
    versions = subprocess.run([py, "-c", "import importlib.metadata as m, sys; print(sys.version.split()[0]); "
                               "print(*(f'{p} {m.version(p)}' for p in ('torch', 'transformers', 'datasets', "
                               "'tqdm', 'lightning')), sep='\\n')"], capture_output=True, text=True, check=True)
    commit = (ROOT / "tests" / "thirdparty" / "nanogpt" / "SOURCE").read_text().splitlines()[1]
    (HERE / "versions.txt").write_text(f"python {versions.stdout}nanoGPT {commit}\n")


if __name__ == "__main__":
    main()
