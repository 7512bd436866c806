"""HF Trainer ``checkpoint-N`` steps written file by file the way the sources write them, without a Trainer.

Followed (transformers 5.23 ``transformers/trainer.py``): ``Trainer._save_checkpoint`` (lines 3355-3420):
``save_model`` (3369) -> ``_save`` (4131-4182: ``save_pretrained`` = config.json, generation_config.json,
weights, then ``training_args.bin``), ``_save_optimizer_and_scheduler`` (3513-3577: DeepSpeed
``save_checkpoint`` 3541-3551, FSDP ``save_fsdp_model``/``save_fsdp_optimizer`` 3552-3559, else
``optimizer.pt`` 3560-3562; ``scheduler.pt`` 3570-3576 unless DeepSpeed owns the scheduler), ``_save_scaler``,
``_save_rng_state`` (3462-3511: ``rng_state.pth``, or ``rng_state_{process_index}.pth`` when world_size > 1),
then ``trainer_state.json`` (3409, rank 0). FSDP SHARDED_STATE_DICT (accelerate 1.15
``utils/fsdp_utils.py``): ``pytorch_model_fsdp_0/`` (177-184) and ``optimizer_0/`` (343-350) are DCP
directories. DeepSpeed 0.19.8 ``runtime/engine.py`` ``save_checkpoint`` (4869-4966): tag ``global_stepN``,
``mp_rank_00_model_states.pt`` (``_get_ckpt_name`` 4336; ``zero_pp_rank_R_mp_rank_00_model_states.pt`` under
ZeRO-3), ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank (4322-4334), ``zero_to_fp32.py``
copied by rank 0, and ``latest`` (4960-4962) written by rank 0 after a barrier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from layout_builders import copy_tree, dcp_template, truncate
from safetensors.torch import save_file

__all__ = ["hf_step", "bench_tree", "truncate"]


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(16, 8, generator=g),
            "model.norm.weight": torch.ones(8), "lm_head.weight": torch.randn(16, 8, generator=g)}


def _json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _save_model(d: Path, sharded: bool, peft: bool) -> None:
    _json(d / "config.json", {"model_type": "llama", "hidden_size": 8, "vocab_size": 16})
    _json(d / "generation_config.json", {"_from_model_config": True})
    w = _weights()
    if peft:
        save_file({"base_model.model.lora_A.weight": torch.zeros(2, 8)}, str(d / "adapter_model.safetensors"))
        _json(d / "adapter_config.json", {"peft_type": "LORA", "r": 2})
    elif sharded:
        names = sorted(w)
        shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
        for fname, keys in shards.items():
            save_file({k: w[k] for k in keys}, str(d / fname))
        _json(d / "model.safetensors.index.json",
              {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}})
    else:
        save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    torch.save({"output_dir": str(d.parent)}, d / "training_args.bin")


def _save_deepspeed(d: Path, step: int, dp: int) -> None:
    tag = d / f"global_step{step}"
    tag.mkdir()
    torch.save({"module": _weights()}, tag / "mp_rank_00_model_states.pt")
    for r in range(dp):
        torch.save({"optimizer_state_dict": {"rank": r}}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (d / "zero_to_fp32.py").write_text("# recovery script\n")
    (d / "latest").write_text(tag.name)


def hf_step(root: Path, step: int, *, sharded: bool = False, peft: bool = False, ranks: int = 1,
            fsdp: bool = False, deepspeed: int = 0) -> Path:
    """One complete ``checkpoint-{step}``: plain, sharded, PEFT, ``ranks`` rng files, FSDP DCP dirs, or
    DeepSpeed ZeRO-2 with ``deepspeed`` data-parallel ranks."""
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    if fsdp:
        copy_tree(dcp_template(), d / "pytorch_model_fsdp_0")
    _save_model(d, sharded, peft)
    if deepspeed:
        _save_deepspeed(d, step, deepspeed)
    elif fsdp:
        copy_tree(dcp_template(), d / "optimizer_0")
    else:
        torch.save({"state": {}, "param_groups": [{"lr": 1e-3}]}, d / "optimizer.pt")
    if not deepspeed:
        torch.save({"last_epoch": step}, d / "scheduler.pt")
    for r in range(ranks):
        torch.save({"cpu": torch.zeros(4, dtype=torch.uint8)}, d / ("rng_state.pth" if ranks == 1 else
                                                                      f"rng_state_{r}.pth"))
    _json(d / "trainer_state.json", {"global_step": step, "epoch": 1.0, "log_history": []})
    return d


def bench_tree(root: Path, steps: int) -> None:
    """``steps`` checkpoint-N dirs (N = 10, 20, ...) hardlinked from one real save; the newest one is left
    as a kill inside the optimizer write leaves it: optimizer.pt cut in half, no rng_state, no trainer_state."""
    root.mkdir(parents=True, exist_ok=True)
    template = hf_step(root / ".template", 0)
    for i in range(1, steps + 1):
        d = root / f"checkpoint-{i * 10}"
        copy_tree(template, d)
        (d / "trainer_state.json").unlink()
        if i < steps:
            _json(d / "trainer_state.json", {"global_step": i * 10, "epoch": 1.0, "log_history": []})
        else:
            truncate(d / "optimizer.pt", 0.5)
            (d / "scheduler.pt").unlink()
            (d / "rng_state.pth").unlink()
    shutil.rmtree(root / ".template")
