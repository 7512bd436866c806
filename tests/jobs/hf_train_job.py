"""A tiny HF Trainer run (LlamaForCausalLM from a config, CPU, one epoch) that resumes the way a user would:
``trainer.train(resume_from_checkpoint=os.environ.get("RLSUP_RESUME_DIR") or None)``.

usage: hf_train_job.py OUT_DIR [--max-steps N] [--save-steps S] [--final FILE]

Test hooks (all optional, environment):
  HF_JOB_LOG            a JSON line per event: start (pid, attempt), resume (the directory, rlsup's verdict on
                        it at load time), train (training began), step (one ended), done (final step).
  HF_JOB_KILL_AT        "ATTEMPT:K,...": in attempt ATTEMPT re-exec (same pid) with tests/kill_matrix.py's
                        RLSUP_TEST_KILL_AT=K, so the process SIGKILLs itself before its K-th file event under
                        RLSUP_TEST_EVENTS_UNDER (a kill inside a save).
Exact resume needs: one epoch (the sampler's permutation is drawn once from the seeded RNG, then
``skip_first_batches``), dropout 0, a fixed init seed.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _maybe_reexec_with_kill_point() -> None:
    sched = os.environ.get("HF_JOB_KILL_AT")
    if not sched or "RLSUP_TEST_KILL_AT" in os.environ:
        return
    attempt = os.environ.get("RLSUP_RESTART_COUNT", "0")
    table = dict(item.split(":") for item in sched.split(",") if item)
    env = dict(os.environ, RLSUP_TEST_KILL_AT=table.get(attempt, "0"))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def log_event(kind: str, **fields: object) -> None:
    """Append one JSON line to HF_JOB_LOG (the test reads it), and print it."""
    line = json.dumps({"event": kind, "pid": os.getpid(), "attempt": os.environ.get("RLSUP_RESTART_COUNT"),
                       "t": time.time(), **fields})
    print("HFJOB " + line, flush=True)
    path = os.environ.get("HF_JOB_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")


def parse_args(argv: list[str]) -> dict:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--final", default="")
    return vars(p.parse_args(argv))


def tiny_llama(vocab: int = 64):
    """A 2-layer LLaMA with hidden size 16, seeded init, no dropout."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def token_rows(n: int, length: int = 16, vocab: int = 64, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g)


def training_args(out: str, max_steps: int, save_steps: int, cls=None, **extra):
    from transformers import TrainingArguments

    cls = cls or TrainingArguments
    return cls(output_dir=out, max_steps=max_steps, save_strategy="steps", save_steps=save_steps,
               per_device_train_batch_size=4, learning_rate=1e-3, use_cpu=True, report_to=[], seed=0,
               data_seed=0, logging_steps=1000, disable_tqdm=True, dataloader_num_workers=0, **extra)


def save_final(model, path: str, step: int) -> None:
    if path:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, path)
    log_event("done", step=step)


def resume_dir() -> str | None:
    """RLSUP_RESUME_DIR ("" on a fresh start), after logging rlsup's own verdict on it at load time."""
    resume = os.environ.get("RLSUP_RESUME_DIR") or None
    if resume:
        from supervisor import layouts

        rec = layouts.verify_path(resume)
        log_event("resume", path=resume, step=rec.step, valid=rec.valid, reason=rec.reason)
    return resume


class _TrainStarted:
    """Logs when training begins and after each step (the test's random kills are timed from these)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Cb(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                log_event("train", step=state.global_step)

            def on_step_end(self, args, state, control, **kwargs):
                log_event("step", step=state.global_step)

        return Cb()


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    log_event("start")
    from transformers import Trainer

    rows = token_rows(opts["max_steps"] * 4)
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    model = tiny_llama()
    args = training_args(opts["out"], opts["max_steps"], opts["save_steps"])
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[_TrainStarted()])
    trainer.train(resume_from_checkpoint=resume_dir())
    save_final(trainer.model, opts["final"], trainer.state.global_step)
    return 0


if __name__ == "__main__":
    _maybe_reexec_with_kill_point()
    sys.exit(main(sys.argv[1:]))
