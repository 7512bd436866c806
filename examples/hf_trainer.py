"""A tiny Hugging Face Trainer run that rlsup can restart from its newest *complete* checkpoint.

    rlsup run --checkpoint-dir out -- python examples/hf_trainer.py

Self-contained (a 2-layer LLaMA built from a config, random tokens, CPU; nothing is downloaded). The one line
that matters is the ``trainer.train(...)`` call: rlsup sets RLSUP_RESUME_DIR to the ``checkpoint-N`` it verified
(or to "" for a fresh start), and HF's own resume loads it. ``resume_from_checkpoint=True`` would instead take
the highest-numbered ``checkpoint-N``, even one a crash left half-written.
"""

from __future__ import annotations

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


def main() -> None:
    out = os.environ.get("RLSUP_CHECKPOINT_DIR", "out")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False))
    rows = torch.randint(1, 64, (256, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    args = TrainingArguments(output_dir=out, max_steps=64, save_steps=8, per_device_train_batch_size=4,
                             learning_rate=1e-3, use_cpu=True, report_to=[], logging_steps=8, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=os.environ.get("RLSUP_RESUME_DIR") or None)


if __name__ == "__main__":
    main()
