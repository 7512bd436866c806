"""NeMo-RL checkpoints: ``step_N/`` committed by renaming ``tmp_step_N`` (NVIDIA-NeMo/RL).

What one save does (``nemo_rl/utils/checkpoint.py`` CheckpointManager and the algorithm loops, e.g.
``nemo_rl/algorithms/grpo.py``, at 01e9028): ``init_tmp_checkpoint`` makes ``tmp_step_N/`` with
``training_info.json`` and ``config.yaml``; the policy writes ``policy/weights`` and
``policy/optimizer`` (DTensor: two ``torch.distributed.checkpoint`` saves, plus ``policy/tokenizer``;
Megatron: ``policy/weights/iter_0000000/`` MCore dist checkpoint with the optimizer inside); the loop
``torch.save``\\ s ``train_dataloader.pt``; ``finalize_checkpoint`` renames ``tmp_step_N`` to
``step_N`` (an existing ``step_N`` is first renamed to ``old_step_N``) and prunes old steps.

The rename is the commit point: ``tmp_step_N`` and ``old_step_N`` are never valid steps. A committed
``step_N`` is still checked file by file (trees copied or synced non-atomically, or torn by storage).
rlsup's own layout (``step_NNNNNNNNN/manifest.rank_*.json``) is detected first; a directory holding
rlsup manifests is never claimed here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from supervisor.layouts import dcp, megatron
from supervisor.layouts.files import check_hf_dir, check_zip, is_dir, read_json, step_dirs, tree_size
from supervisor.layouts.record import Check, CheckpointRecord

NAME = "nemo-rl"
NAME_RE = re.compile(r"^(tmp_|old_)?step_(\d+)$")  # NeMo-RL's names (unpadded), not rlsup's
TRAINING_INFO = "training_info.json"
CONFIG = "config.yaml"
COMPONENTS = ("policy", "value", "teacher")
DATALOADER_GLOB = "train_dataloader*.pt"
RLSUP_MANIFEST_GLOB = "manifest.rank_*.json"


@dataclass
class NemoRLContext:
    """Run-wide facts: whether committed steps of this run carry dataloader state."""

    expects_dataloader: bool


def _is_rlsup(path: Path) -> bool:
    try:
        return any(path.glob(RLSUP_MANIFEST_GLOB))
    except OSError:
        return False


def step_of(path: Path) -> int | None:
    """N of ``step_N``, ``tmp_step_N`` or ``old_step_N``."""
    m = NAME_RE.match(path.name)
    return int(m.group(2)) if m else None


def is_committed(path: Path) -> bool:
    """``step_N`` (renamed in), as opposed to ``tmp_step_N`` / ``old_step_N``."""
    m = NAME_RE.match(path.name)
    return bool(m) and m.group(1) is None


def owns(path: Path) -> bool:
    """A NeMo-RL step directory (committed or not), never one holding rlsup manifests."""
    if step_of(path) is None or not is_dir(path) or _is_rlsup(path):
        return False
    if not is_committed(path):
        return True
    return (path / TRAINING_INFO).exists() or any(is_dir(path / c) for c in COMPONENTS)


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """``step_N``, ``tmp_step_N`` and ``old_step_N`` directories; the committed one sorts last per step."""
    found = step_dirs(root, step_of, keep=lambda path: not _is_rlsup(path))
    return sorted(found, key=lambda t: (t[0], is_committed(t[1]), t[1].name))


def looks_like(root: Path) -> bool:
    """Some step directory has NeMo-RL's files (or is a ``tmp_step_N``); rlsup trees never qualify."""
    return any(owns(p) for _, p in list_steps(root)[-4:])


def make_context(root: Path) -> NemoRLContext:
    for _, path in list_steps(root):
        if is_committed(path) and any(path.glob(DATALOADER_GLOB)):
            return NemoRLContext(expects_dataloader=True)
    return NemoRLContext(expects_dataloader=False)


def check_weights(weights: Path) -> Check:
    """``weights/`` is a DCP (DTensor), an MCore ``iter_*`` directory (Megatron) or safetensors (Automodel)."""
    if not is_dir(weights):
        return Check.bad(f"{weights.parent.name}/{weights.name}/ missing")
    label = f"{weights.parent.name}/{weights.name}"
    if dcp.looks_like_dcp(weights):
        c = dcp.check_dcp(weights)
        return c if c.ok else Check.bad(f"{label}: {c.reason}")
    iters = sorted(p for p in weights.glob("iter_*") if p.is_dir())
    if iters:
        for it in iters:
            c = megatron.check_mcore_dist(it)
            if not c.ok:
                return Check.bad(f"{label}/{c.reason}")
        return Check.good()
    hf_dir = weights / "model" if is_dir(weights / "model") else weights
    if any(hf_dir.glob("*.safetensors")) or any(hf_dir.glob("*.index.json")):
        c = check_hf_dir(hf_dir, need_weights=True)
        return c if c.ok else Check.bad(f"{label}: {c.reason}")
    return Check.bad(f"{label}/ holds no DCP, MCore or safetensors checkpoint")


def check_component(comp: Path) -> Check:
    weights = check_weights(comp / "weights")
    if not weights.ok:
        return weights
    optimizer = comp / "optimizer"
    if is_dir(optimizer) and dcp.looks_like_dcp(optimizer):
        c = dcp.check_dcp(optimizer)
        if not c.ok:
            return Check.bad(f"{comp.name}/optimizer: {c.reason}")
    elif is_dir(optimizer) and not any(optimizer.iterdir()):
        return Check.bad(f"{comp.name}/optimizer/ is empty")
    return Check.good(weights.notes)


def check_step(path: Path, ctx: NemoRLContext) -> Check:
    if not is_committed(path):
        return Check.bad(f"{path.name} is uncommitted (NeMo-RL renames tmp_step_N to step_N when the save "
                         "is complete; old_step_N is a step being replaced)")
    info, err = read_json(path / TRAINING_INFO)
    if err:
        return Check.bad(err)
    if not isinstance(info, dict):
        return Check.bad(f"{TRAINING_INFO} is not an object")
    try:
        if (path / CONFIG).exists() and (path / CONFIG).stat().st_size == 0:
            return Check.bad(f"{CONFIG} is empty (torn write)")
    except OSError as exc:
        return Check.bad(f"{CONFIG} unreadable: {exc}")
    comps = [path / c for c in COMPONENTS if is_dir(path / c)]
    if not comps:
        return Check.bad(f"no model component ({', '.join(COMPONENTS)}) in the step")
    notes: list[str] = []
    for comp in comps:
        c = check_component(comp)
        if not c.ok:
            return c
        notes.extend(c.notes)
    loaders = sorted(path.glob(DATALOADER_GLOB))
    if ctx.expects_dataloader and not loaders:
        return Check.bad("train_dataloader.pt missing (other steps of this run have it)", notes)
    for f in loaders:
        c = check_zip(f)
        if not c.ok:
            return Check.bad(c.reason, notes)
    return Check.good(notes)


def verify_step(path: Path, step: int | None = None, ctx: NemoRLContext | None = None) -> CheckpointRecord:
    """Valid: a committed ``step_N`` whose training_info.json parses, every model component's weights
    (and optimizer, when saved) are complete, and the dataloader state is intact."""
    check = check_step(path, ctx or make_context(path.parent))
    s = step if step is not None else step_of(path)
    return CheckpointRecord.of_check(check, step=s, layout=NAME, path=path, size_bytes=tree_size(path))
