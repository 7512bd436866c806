"""DeepSpeed ``save_checkpoint`` trees for tests and benchmarks, and the trainer-side logic rlsup guards.

Two sources: copies of a real save (tests/jobs/deepspeed_save_job.py), and trees built from the
deepspeed 0.19.8 source (``deepspeed/runtime/engine.py``: ``_get_ckpt_name``, ``_get_rank_zero_ckpt_name``,
``_common_checkpoint_state``, ``_save_zero_checkpoint``; ``runtime/pipe/module.py``: ``ckpt_layer_path``)
for what one CPU can't run (ZeRO-3, model/pipeline parallelism, bf16). ``deepspeed_would_load`` and
``openrlhf_retention`` restate what the trainers do, so tests can say where they pick a broken step.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

LATEST = "latest"


def deepspeed_would_load(save_dir: Path) -> str | None:
    """The tag ``engine.load_checkpoint(save_dir)`` (tag=None) loads: ``latest`` read as engine.py does."""
    path = save_dir / LATEST
    if not path.is_file():
        return None
    with open(path) as fd:
        return fd.read().strip()


def openrlhf_retention(save_dir: Path, max_num: int) -> list[str]:
    """OpenRLHF's ``DeepspeedStrategy.save_ckpt`` retention (openrlhf/utils/deepspeed/deepspeed.py), run
    by rank 0 *before* ``save_checkpoint``: delete the oldest subdirectory by mtime while there are
    ``max_num`` or more (the size limit is left out). Returns the names it deleted."""
    deleted = []
    while True:
        subdirs = sorted(((d, d.stat().st_mtime) for d in save_dir.iterdir() if d.is_dir()), key=lambda x: x[1])
        if len(subdirs) < max_num:
            return deleted
        shutil.rmtree(subdirs[0][0])
        deleted.append(subdirs[0][0].name)


def copy_tree(src: Path, dst: Path, link: bool = False) -> Path:
    """Copy (or hardlink) a save dir; a fresh directory per kill case."""
    shutil.copytree(src, dst, copy_function=os.link if link else shutil.copy2)
    return dst


def truncate_half(path: Path) -> int:
    """Cut a file to half its length (a kill inside its write); returns the new size."""
    size = path.stat().st_size // 2
    os.truncate(path, size)
    return size


def _ds_config(stage: int, bf16: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}


def model_states(step: int, dp: int, mp: int, stage: int, bf16: bool, pipeline: bool) -> dict:
    """The keys ``_common_checkpoint_state`` writes, with a tiny module."""
    module = None if pipeline else {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    return dict(module=module, buffer_names=[], optimizer=None, param_shapes=[{"w": torch.Size([4, 4])}],
                frozen_param_shapes=None, shared_params={}, frozen_param_fragments=None, lr_scheduler=None,
                data_sampler=None, random_ltd=None, skipped_steps=0, global_steps=step, global_samples=step,
                dp_world_size=dp, mp_world_size=mp, ds_config=_ds_config(stage, bf16), ds_version="0.19.8")


def synthetic_tag(save_dir: Path, step: int, *, dp: int = 2, mp: int = 1, stage: int = 1, bf16: bool = False,
                  layers: int = 0, write_latest: bool = True) -> Path:
    """One complete ``global_step{step}`` as deepspeed 0.19.8 names its files, plus ``latest``."""
    tag = save_dir / f"global_step{step}"
    tag.mkdir(parents=True, exist_ok=True)
    pipeline = layers > 0
    for li in range(layers):
        torch.save({"weight": torch.zeros(2)}, tag / f"layer_{li:02d}-model_states.pt")
    state = model_states(step, dp, mp, stage, bf16, pipeline)
    for m in range(mp):
        if stage >= 3:
            for d in range(dp):
                torch.save(state, tag / f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt")
        else:
            torch.save(state, tag / f"mp_rank_{m:02d}_model_states.pt")
        if stage >= 1 or bf16:
            prefix = "bf16_" if bf16 else ""
            for d in range(dp):
                shard = {"optimizer_state_dict": {"state": {0: {"exp_avg": torch.zeros(8)}}},
                         "ds_config": _ds_config(stage, bf16), "ds_version": "0.19.8"}
                torch.save(shard, tag / f"{prefix}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt")
    if write_latest:
        (save_dir / LATEST).write_text(tag.name)
    return tag


def bench_tree(root: Path, steps: int) -> None:
    """``steps`` tags (dp 2, ZeRO-1), hardlinks of one save; the newest is what a rank dying in the
    save leaves: rank 1's optimizer shard missing, while ``latest`` (rank 0 wrote it) already names it."""
    root.mkdir(parents=True, exist_ok=True)
    first = synthetic_tag(root, 1, dp=2, stage=1, write_latest=False)
    for step in range(2, steps + 1):
        copy_tree(first, root / f"global_step{step}", link=True)
    (root / f"global_step{steps}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (root / LATEST).write_text(f"global_step{steps}")
