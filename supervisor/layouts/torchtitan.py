"""torchtitan checkpoints: ``<dump_folder>/<checkpoint.folder>/step-N/``, one DCP directory per step.

What one save does (pytorch/torchtitan ``torchtitan/components/checkpointer/dcp.py`` at b5bcd76):
``CheckpointManager._save`` calls ``dcp.save`` (or ``dcp.async_save``) of the flattened states (model
keys at the top, ``train_state``, ``optimizer``, ``lr_scheduler``, ``dataloader``) into ``step-N``:
shards first, ``.metadata`` last through ``.metadata.tmp`` + rename, so ``.metadata`` is the commit
point. ``_purge_stale_checkpoints`` then ``rmtree``\\ s all but ``keep_latest_k`` steps (in a thread).
The last step may instead be saved model-only (``last_save_model_only``, optionally in ``export_dtype``)
or as HuggingFace safetensors (``last_save_in_hf``: ``model-*.safetensors`` +
``model.safetensors.index.json``, written last, plus a ``sharded/`` staging directory); neither holds
the optimizer, so training cannot resume from it. Step 0 (the seed checkpoint) is model-only by design
and torchtitan loads it model-only.

Detection is specific so plain DCP roots stay ``dcp``: ``step-N`` names plus a ``.metadata`` carrying
torchtitan's state keys, or an HF export ``step-N``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from supervisor.layouts import dcp
from supervisor.layouts.files import check_hf_dir, is_dir, step_dirs, tree_size
from supervisor.layouts.record import Check, CheckpointRecord

NAME = "torchtitan"
STEP_RE = re.compile(r"^step-(\d+)$")
HF_INDEX = "model.safetensors.index.json"
TRAINING_KEYS = ("train_state", "optimizer", "lr_scheduler", "dataloader")


def step_of(path: Path) -> int | None:
    m = STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def _top_keys(metadata: Any) -> set[str]:
    """First components of the FQNs in a DCP ``.metadata`` (DCP flattens nested dicts with dots)."""
    keys = getattr(metadata, "state_dict_metadata", None)
    return {str(k).split(".", 1)[0] for k in keys} if isinstance(keys, dict) else set()


def is_hf_export(path: Path) -> bool:
    return (path / HF_INDEX).exists() or is_dir(path / "sharded") or any(path.glob("*.safetensors"))


def is_torchtitan_step(path: Path) -> bool:
    """``step-N`` that is an HF export, or whose ``.metadata`` has torchtitan's training state keys."""
    if step_of(path) is None or not is_dir(path):
        return False
    if is_hf_export(path):
        return True
    metadata, err = dcp.load_metadata(path)
    return err is None and bool(_top_keys(metadata) & set(TRAINING_KEYS))


def owns(path: Path) -> bool:
    """A ``step-N`` directory that is torchtitan's, or a DCP one beside torchtitan steps (killed saves)."""
    if step_of(path) is None or not is_dir(path):
        return False
    return is_torchtitan_step(path) or looks_like(path.parent)


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` directory, empty ones included (a save killed right after its mkdir)."""
    return step_dirs(root, step_of)


def looks_like(root: Path) -> bool:
    """Some of the newest ``step-N`` directories is torchtitan's (reads at most a few ``.metadata`` pickles)."""
    return any(is_torchtitan_step(p) for _, p in list_steps(root)[-4:])


def make_context(root: Path) -> None:
    return None


def check_hf_export(path: Path) -> Check:
    if not (path / HF_INDEX).exists():
        return Check.bad(f"HF export without {HF_INDEX} (written last: killed while consolidating)")
    c = check_hf_dir(path, need_weights=True)
    if not c.ok:
        return c
    return Check.bad("complete HF safetensors export (last_save_in_hf): model weights only, torchtitan cannot "
                     "resume training from it", c.notes)


def check_step(path: Path, step: int) -> Check:
    if is_hf_export(path):
        return check_hf_export(path)
    check = dcp.check_dcp(path)
    if not check.ok:
        return check
    metadata, err = dcp.load_metadata(path)
    if err:
        return Check.bad(err)
    keys = _top_keys(metadata)
    if keys & set(TRAINING_KEYS):
        missing = [k for k in ("train_state", "optimizer") if k not in keys]
        if missing:
            return Check.bad(f".metadata lacks {', '.join(missing)} (not a full torchtitan save)", check.notes)
        return check
    if step == 0:
        return Check.good(check.notes + ["seed checkpoint (step 0): model only, torchtitan loads it model-only"])
    return Check.bad("model-only save (last_save_model_only): no optimizer or train_state, torchtitan cannot "
                     "resume training from it", check.notes)


def verify_step(path: Path, step: int | None = None, ctx: Any = None) -> CheckpointRecord:
    """Valid: the DCP checks hold (``.metadata`` loads, every shard long enough) and it is a full
    training save (``train_state`` and ``optimizer`` keys), or the step-0 seed checkpoint."""
    s = step if step is not None else step_of(path)
    s = -1 if s is None else s
    check = check_step(path, s)
    return CheckpointRecord.of_check(check, step=s, layout=NAME, path=path, size_bytes=tree_size(path))
