"""Megatron-Core / Megatron-Bridge ``iter_NNNNNNN`` checkpoints (torch_dist format).

What one complete step holds, in the order it is written:

* MCore ``dist_checkpointing.save``: ``common.pt`` (rank 0), the ``*.distcp`` shards, DCP
  ``.metadata``, then ``metadata.json`` ({"sharded_backend": "torch_dist", ...}) last. No
  ``metadata.json`` means the save never finished.
* Megatron-Bridge then adds ``train_state.pt``, copies it to the root's ``latest_train_state.pt``,
  writes the root tracker ``latest_checkpointed_iteration.txt`` and finally ``run_config.yaml``. A
  Bridge step without ``run_config.yaml`` was killed in that finalize phase, after the tracker was
  already moved to it.

The root trackers are hints only: they are written with a plain ``open("w")`` and can be torn, and
retention (``most_recent_k``) can leave them naming a deleted step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from supervisor.layouts import dcp
from supervisor.layouts.files import check_zip, read_json, tree_size
from supervisor.layouts.record import Check, CheckpointRecord

NAME = "megatron"
ITER_RE = re.compile(r"^iter_(\d+)$")
TRACKER = "latest_checkpointed_iteration.txt"
BRIDGE_TRACKER = "latest_train_state.pt"
MCORE_CONFIG = "metadata.json"
COMMON = "common.pt"
BRIDGE_TRAIN_STATE = "train_state.pt"
BRIDGE_RUN_CONFIG = "run_config.yaml"
BRIDGE_ENERGON = "energon"
ENERGON_STATES = "train_dataloader_dprank*.pt"


@dataclass
class MegatronContext:
    """Run-wide facts that decide what a single step must contain."""

    bridge: bool


def is_mcore_dist_dir(directory: Path) -> bool:
    return (directory / MCORE_CONFIG).exists() or (directory / COMMON).exists()


def check_mcore_dist(directory: Path) -> Check:
    """An MCore ``dist_checkpointing`` directory (also what verl writes under ``*/dist_ckpt``)."""
    if not directory.is_dir():
        return Check.bad(f"{directory.name}/ missing")
    config, err = read_json(directory / MCORE_CONFIG)
    if err:
        if "missing" in err:
            err += " (MCore writes it last: save never finished)"
        return Check.bad(f"{directory.name}/{err}")
    if not isinstance(config, dict):
        return Check.bad(f"{directory.name}/{MCORE_CONFIG} is not an object")
    notes: list[str] = []
    common = check_zip(directory / COMMON)
    if not common.ok:
        return Check.bad(f"{directory.name}/{common.reason}")
    notes.extend(common.notes)
    backend = config.get("sharded_backend")
    if backend == "torch_dist":
        shards = dcp.check_dcp(directory)
        if not shards.ok:
            return Check.bad(f"{directory.name}/: {shards.reason}")
        notes.extend(shards.notes)
    else:
        notes.append(f"sharded_backend {backend!r}: shard files not checked")
    return Check.good(notes)


def check_legacy_torch(directory: Path) -> Check:
    """Megatron-LM's pre-dist format: ``mp_rank_XX[_YYY]/model_optim_rng.pt`` per model-parallel rank."""
    ranks = sorted(p for p in directory.glob("mp_rank_*") if p.is_dir())
    if not ranks:
        return Check.bad("no metadata.json and no mp_rank_* directories")
    for r in ranks:
        c = check_zip(r / "model_optim_rng.pt")
        if not c.ok:
            return Check.bad(f"{r.name}/{c.reason}")
    return Check.good(["legacy torch format; which mp ranks should exist is not recorded, only present ones checked"])


def make_context(root: Path) -> MegatronContext:
    """Bridge runs are recognised by the root copy of the train state or any step's Bridge files."""
    if (root / BRIDGE_TRACKER).exists():
        return MegatronContext(bridge=True)
    for _, path in list_steps(root)[-3:]:
        if (path / BRIDGE_RUN_CONFIG).exists() or (path / BRIDGE_TRAIN_STATE).exists():
            return MegatronContext(bridge=True)
    return MegatronContext(bridge=False)


def check_iter_dir(path: Path, ctx: MegatronContext | None = None) -> Check:
    ctx = ctx or make_context(path.parent)
    bridge = ctx.bridge or (path / BRIDGE_RUN_CONFIG).exists() or (path / BRIDGE_TRAIN_STATE).exists()
    if (path / MCORE_CONFIG).exists() or (path / COMMON).exists() or dcp.looks_like_dcp(path):
        check = check_mcore_dist(path)
    elif any(path.glob("mp_rank_*")):
        check = check_legacy_torch(path)
    else:
        return Check.bad(f"empty step: no {MCORE_CONFIG}, shards or mp_rank_* (killed before writing)")
    if not check.ok or not bridge:
        return check
    train_state = check_zip(path / BRIDGE_TRAIN_STATE)
    if not train_state.ok:
        return Check.bad(f"Bridge {train_state.reason} (killed in finalize)", check.notes)
    try:
        if (path / BRIDGE_RUN_CONFIG).stat().st_size == 0:
            return Check.bad(f"Bridge {BRIDGE_RUN_CONFIG} is empty (killed in finalize)", check.notes)
    except FileNotFoundError:
        return Check.bad(f"Bridge {BRIDGE_RUN_CONFIG} missing (written last; killed in finalize)", check.notes)
    notes = check.notes
    # Energon's per-DP-rank loader states (maybe_save_dataloader_state): <save>/energon/iter_N/ by default,
    # in iter_N/ itself where dataset.dataloader_save is the save dir. Elsewhere: not checked (docs say so).
    for loader, shown in ((path.parent / BRIDGE_ENERGON / path.name, f"{BRIDGE_ENERGON}/{path.name}/"), (path, "")):
        for f in sorted(loader.glob(ENERGON_STATES)) if loader.is_dir() else ():
            c = check_zip(f)
            if not c.ok:
                return Check.bad(f"{shown}{c.reason}", notes)
    return Check.good(notes)


def bridge_tracker_mismatch(root: Path, step_dir: Path) -> str | None:
    """Why Bridge's own tracker does not agree with the step the text tracker names (None: it agrees,
    or this is no Bridge run). Bridge reads ``latest_train_state.pt`` before the text tracker and
    writes it first (a copy of the step's ``train_state.pt``), so a kill between the two leaves it
    torn or naming a step the text tracker does not."""
    latest = root / BRIDGE_TRACKER
    if not latest.exists():
        return None
    try:
        same = latest.read_bytes() == (step_dir / BRIDGE_TRAIN_STATE).read_bytes()
    except OSError as e:
        return f"{BRIDGE_TRACKER} unreadable against {step_dir.name}/{BRIDGE_TRAIN_STATE}: {e}"
    return None if same else f"{BRIDGE_TRACKER} is not {step_dir.name}'s {BRIDGE_TRAIN_STATE} (torn, or another step's)"


def looks_like(root: Path) -> bool:
    return bool(list_steps(root)) or (root / BRIDGE_TRACKER).exists()


def list_steps(root: Path) -> list[tuple[int, Path]]:
    out = []
    try:
        for child in root.iterdir():
            m = ITER_RE.match(child.name)
            if m and child.is_dir():
                out.append((int(m.group(1)), child))
    except OSError:
        return []
    return sorted(out, key=lambda t: t[0])


def step_of(path: Path) -> int | None:
    m = ITER_RE.match(path.name)
    return int(m.group(1)) if m else None


def verify_step(path: Path, step: int | None = None, ctx: MegatronContext | None = None) -> CheckpointRecord:
    check = check_iter_dir(path, ctx)
    s = step if step is not None else step_of(path)
    return CheckpointRecord.of_check(check, step=s, layout=NAME, path=path, size_bytes=tree_size(path))
