"""Set-up for the third-party trainers of tests/thirdparty/test_thirdparty_trainers_e2e.py (issue 28): the programs are run as
their authors ship them, only their inputs are built here, locally, without a download.

- nanoGPT (karpathy/nanoGPT, MIT): ``train.py``, ``model.py``, ``configurator.py``, unmodified, used when
  present in ``nanogpt/`` with the sha256 sums that ``nanogpt/SOURCE`` records (it says how to put them there;
  they are not committed: code fetched from elsewhere stays out of this repository's commits). nanoGPT reads ``configurator.py`` and ``data/<dataset>/`` relative to
  its working directory, so :func:`nanogpt_workdir` copies the three files into the run's directory and writes
  ``data/tiny/{train,val}.bin`` and ``meta.pkl`` the way ``data/shakespeare_char/prepare.py`` does (character
  ids as uint16, a 90/10 split), from generated text instead of the downloaded Shakespeare.
- ``trl sft`` (the installed trl's console script, Apache-2.0, unmodified; ``trl/scripts/sft.py`` of the wheel):
  :func:`hf_model_dir` saves a tiny seeded LLaMA (2 layers, hidden 32) with a WordLevel tokenizer trained by the
  ``tokenizers`` library on the generated text (``PreTrainedTokenizerFast.save_pretrained``);
  :func:`text_dataset` writes a local ``train.jsonl`` with a ``text`` column.
- ``run_clm.py`` (huggingface/transformers ``examples/pytorch/language-modeling/run_clm.py``, Apache-2.0):
  used when present at ``hf_run_clm/run_clm.py`` or ``$RLSUP_RUN_CLM`` (see hf_run_clm/README.md for why it
  is not committed here); :func:`hf_config_dir` is its ``--config_name``/``--tokenizer_name`` directory.

Run as a script it builds everything into a directory: ``python tests/thirdparty/setup_trainers.py DIR``.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NANOGPT = HERE / "nanogpt"
NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
RUN_CLM = HERE / "hf_run_clm" / "run_clm.py"

# nanoGPT on CPU in a few seconds (2 cores): a 2-layer GPT, hidden 128, a ~5 MB ckpt.pt (model + AdamW
# moments), saved every EVAL_INTERVAL iterations (always_save_checkpoint), MAX_ITERS + 1 iterations.
NANOGPT_MAX_ITERS, NANOGPT_EVAL_INTERVAL = 160, 20
NANOGPT_FLAGS = ["--dataset=tiny", "--device=cpu", "--compile=False", "--dtype=float32", "--n_layer=2",
                 "--n_head=4", "--n_embd=128", "--block_size=64", "--batch_size=8",
                 "--gradient_accumulation_steps=1", f"--max_iters={NANOGPT_MAX_ITERS}",
                 f"--eval_interval={NANOGPT_EVAL_INTERVAL}", "--eval_iters=2", "--log_interval=1",
                 "--always_save_checkpoint=True", "--out_dir=out"]


def generated_text(lines: int = 3000, seed: int = 0) -> str:
    """Deterministic word salad over 200 made-up words (stands in for a downloaded corpus)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(200)]
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(lines))


def nanogpt_missing() -> str | None:
    """Why nanoGPT's files cannot be used (absent, or not the recorded commit's bytes), or None."""
    import hashlib

    sums = dict(line.split()[::-1] for line in (NANOGPT / "SOURCE").read_text().splitlines()
                if len(line.split()) == 2 and len(line.split()[0]) == 64)
    for name in (*NANOGPT_FILES, "LICENSE"):
        path = NANOGPT / name
        if not path.is_file():
            return f"{path} is not here: tests/thirdparty/nanogpt/SOURCE says how to put nanoGPT's files there"
        if hashlib.sha256(path.read_bytes()).hexdigest() != sums.get(name):
            return f"{path} is not karpathy/nanoGPT's file at the commit SOURCE names (sha256 differs)"
    return None


def nanogpt_workdir(dest: Path, dataset: str = "tiny") -> Path:
    """``dest`` with nanoGPT's three files and ``data/<dataset>/`` as its char-level prepare.py writes them."""
    import numpy as np

    if (why := nanogpt_missing()) is not None:
        import pytest

        pytest.skip(why)

    dest.mkdir(parents=True, exist_ok=True)
    for name in NANOGPT_FILES:
        shutil.copy2(NANOGPT / name, dest / name)
    data = dest / "data" / dataset
    data.mkdir(parents=True, exist_ok=True)
    text = generated_text()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = len(ids)
    ids[: int(n * 0.9)].tofile(data / "train.bin")
    ids[int(n * 0.9):].tofile(data / "val.bin")
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return dest


def _tokenizer(text: str):
    """A WordLevel tokenizer trained on ``text`` by the tokenizers library, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(text.splitlines(), trainers.WordLevelTrainer(
        vocab_size=256, special_tokens=["<pad>", "<unk>", "<bos>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<bos>", eos_token="<eos>", model_max_length=64)


def _llama_config(vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                       attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=2,
                       eos_token_id=3)


def hf_config_dir(dest: Path) -> Path:
    """A config + tokenizer directory (``--config_name``/``--tokenizer_name`` of run_clm.py): no weights."""
    dest.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(generated_text())
    tok.save_pretrained(dest)
    _llama_config(len(tok)).save_pretrained(dest)
    return dest


def hf_model_dir(dest: Path) -> Path:
    """A model directory (``--model_name_or_path`` of ``trl sft``): config, seeded weights, tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config_dir(dest)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(dest)).save_pretrained(dest)
    return dest


def text_dataset(dest: Path, rows: int = 400) -> Path:
    """``dest/train.jsonl`` (a ``text`` column) and ``dest/train.txt`` (one line per row), local files."""
    dest.mkdir(parents=True, exist_ok=True)
    lines = generated_text(rows, seed=1).splitlines()
    (dest / "train.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    (dest / "train.txt").write_text("\n".join(lines) + "\n")
    return dest


def run_clm_path() -> Path | None:
    """The run_clm.py to run (``$RLSUP_RUN_CLM`` or hf_run_clm/run_clm.py), or None when neither exists."""
    for p in (os.environ.get("RLSUP_RUN_CLM"), RUN_CLM):
        if p and Path(p).is_file():
            return Path(p)
    return None


if __name__ == "__main__":  # pragma: no cover
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "thirdparty-run")
    nanogpt_workdir(root / "nanogpt")
    hf_model_dir(root / "tiny-llama")
    text_dataset(root / "data")
    print(f"built under {root}")
