"""Lightning checkpoints for rlsup's tests: the real writer (``tests/jobs/lightning_train_job.py``,
``Trainer.save_checkpoint``), what Lightning's own ``ckpt_path="last"`` would resume from, and
source-derived builders for the strategy directories that cannot run on this CPU-only machine.

* sharded FSDP / ModelParallel (``lightning/pytorch/strategies/fsdp.py`` ``save_checkpoint``, lines
  563-577 of lightning 2.6.6): ``mkdir``, ``torch.distributed.checkpoint.save({"model": ...,
  "optimizer_0": ...})`` into the ``.ckpt`` directory, then rank 0 ``torch.save(rest, "meta.pt")``.
* DeepSpeed (``lightning/pytorch/strategies/deepspeed.py`` ``save_checkpoint`` -> deepspeed 0.19.8
  ``runtime/engine.py`` ``save_checkpoint`` / ``_save_checkpoint`` / ``_save_zero_checkpoint``):
  ``<dir>/checkpoint/mp_rank_00_model_states.pt`` (``module``, ``dp_world_size``, ..., plus the
  Lightning dict without ``state_dict``/``optimizer_states``), one
  ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank, then ``latest`` (the tag).
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "lightning_train_job.py"
_TEMPLATE: Path | None = None


def job_cmd(dirpath: Path, *extra: str) -> list[str]:
    return [sys.executable, str(JOB), "--dirpath", str(dirpath), *extra]


def ckpt_template() -> Path:
    """One real Lightning ``.ckpt`` (2 training steps, then ``Trainer.save_checkpoint``), made once."""
    global _TEMPLATE
    if _TEMPLATE is None:
        from support.template_cache import cached, version_of

        def build(into: Path) -> None:
            import lightning as L
            from torch.utils.data import DataLoader, TensorDataset

            sys.path.insert(0, str(JOB.parent))
            from lightning_train_job import Tiny

            data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, enable_progress_bar=False,
                                    logger=False, enable_model_summary=False, enable_checkpointing=False)
                trainer.fit(Tiny(), DataLoader(data, batch_size=4))
                trainer.save_checkpoint(into / "template.ckpt")

        # kept between runs (support.template_cache): the real save imports Lightning and trains, seconds
        _TEMPLATE = cached(f"lightning-ckpt_{version_of('lightning', 'torch')}", build) / "template.ckpt"
    return _TEMPLATE


def ckpt_file(path: Path, step: int) -> Path:
    """A real ``.ckpt`` whose pickled ``global_step`` is ``step`` (re-saved from the template)."""
    state = torch.load(ckpt_template(), map_location="cpu", weights_only=False)
    state["global_step"] = step
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def fsdp_sharded_dir(path: Path, step: int) -> Path:
    """A sharded-FSDP ``.ckpt`` directory, in the strategy's order (DCP first, ``meta.pt`` last)."""
    import torch.distributed.checkpoint as dcp

    state = torch.load(ckpt_template(), map_location="cpu", weights_only=False)
    state["global_step"] = step
    converted = {"model": state.pop("state_dict")}
    converted.update({f"optimizer_{i}": o for i, o in enumerate(state.pop("optimizer_states", []))})
    path.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(converted, checkpoint_id=str(path))
    torch.save(state, path / "meta.pt")
    return path


def deepspeed_dir(path: Path, step: int, world: int = 2) -> Path:
    """A DeepSpeed-strategy ``.ckpt`` directory: model states, ``world`` ZeRO shards, ``latest`` last."""
    state = torch.load(ckpt_template(), map_location="cpu", weights_only=False)
    state["global_step"] = step
    module = state.pop("state_dict")
    optim = state.pop("optimizer_states", [])
    tag = path / "checkpoint"
    tag.mkdir(parents=True, exist_ok=True)
    torch.save({"module": module, "dp_world_size": world, "mp_world_size": 1, "global_steps": step,
                "ds_version": "0.19.8", **state}, tag / "mp_rank_00_model_states.pt")
    for r in range(world):
        torch.save({"optimizer_state_dict": optim[0] if optim else {}, "ds_version": "0.19.8"},
                   tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (path / "latest").write_text("checkpoint")
    return path


def truncate_half(path: Path) -> None:
    """What a kill inside a write leaves: the first half of the file."""
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)


def lightning_last_pick(root: Path) -> Path | None:
    """What ``trainer.fit(ckpt_path="last")`` resumes from (checkpoint_connector._parse_ckpt_path:
    the ``last*.ckpt`` files ModelCheckpoint finds, newest mtime); None: it starts from scratch."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.fabric.utilities.cloud_io import get_filesystem

    found = ModelCheckpoint(dirpath=str(root))._find_last_checkpoints(None)  # type: ignore[arg-type]
    stamps = {p: get_filesystem(p).modified(p) for p in found if get_filesystem(p).exists(p)}
    return Path(max(stamps, key=stamps.get)) if stamps else None


def lightning_can_load(path: Path) -> bool:
    """Whether Lightning's loader (``pl_load``) reads the checkpoint (a torn zip raises)."""
    from lightning.fabric.utilities.cloud_io import _load as pl_load

    try:
        state = pl_load(str(path), map_location="cpu", weights_only=False)
    except Exception:
        return False
    return isinstance(state, dict) and "state_dict" in state


def bench_tree(root: Path, steps: int) -> None:
    """``steps`` Lightning checkpoints (hardlinks of one real ``.ckpt``, named ``epoch=0-step=S``;
    the name gives the step) plus ``last.ckpt``; the newest is cut in half, as a kill during an
    in-place or cross-filesystem write leaves it, so selection must fall back one step."""
    root.mkdir(parents=True, exist_ok=True)
    src = ckpt_template()
    for s in range(1, steps + 1):
        dst = root / f"epoch=0-step={s}.ckpt"
        if s == steps:
            shutil.copyfile(src, dst)
            truncate_half(dst)
            continue
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    if steps > 1:
        os.symlink(f"epoch=0-step={steps - 1}.ckpt", root / "last.ckpt")
