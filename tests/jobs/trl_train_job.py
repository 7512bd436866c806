"""A tiny TRL SFTTrainer run (the LLaMA of hf_train_job.py, a WordLevel tokenizer built in code, CPU) resuming
through HF's mechanism from RLSUP_RESUME_DIR. Same arguments and test hooks as hf_train_job.py."""

from __future__ import annotations

import sys

from hf_train_job import (_maybe_reexec_with_kill_point, _TrainStarted, log_event, parse_args, resume_dir, save_final,
                          tiny_llama, token_rows, training_args)

VOCAB = 64


def word_tokenizer():
    """PreTrainedTokenizerFast over a WordLevel vocabulary w1..w63, pad token id 0 (no hub download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, VOCAB - 1)}, "<eos>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    log_event("start")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = token_rows(opts["max_steps"] * 4, vocab=VOCAB - 1)
    texts = [" ".join(f"w{int(t)}" for t in r) for r in rows]
    args = training_args(opts["out"], opts["max_steps"], opts["save_steps"], cls=SFTConfig, max_length=32)
    trainer = SFTTrainer(model=tiny_llama(VOCAB), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=word_tokenizer(), callbacks=[_TrainStarted()])
    trainer.train(resume_from_checkpoint=resume_dir())
    save_final(trainer.model, opts["final"], trainer.state.global_step)
    return 0


if __name__ == "__main__":
    _maybe_reexec_with_kill_point()
    sys.exit(main(sys.argv[1:]))
