"""Layout-aware checkpoint catalogue: find the newest checkpoint a restart can actually use.

Reads files only (no processes, no network); tensor bytes are read only for rlsup's own format,
whose manifests carry checksums. One module per on-disk layout, each exposing ``looks_like(root)``,
``list_steps(root)`` (cheap listing), ``make_context(root)`` (run-wide hints) and
``verify_step(path, step, ctx)``; this module picks the layout and walks the steps. The trainer layouts
of issue 18 (:data:`TRAINER_LAYOUTS`) also expose ``owns(path)``, so :func:`verify_path` can ask them
whether one directory (or file) is a step of theirs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable
from types import ModuleType

from rlsup_format.manifest import KnownDigests
from supervisor.layouts import (areal, dcp, deepspeed, hf, lightning, megatron, nemo, nemo_rl, rlsup, single_file,
                                torchtitan, tracker, verl)
from supervisor.layouts.files import tree_size
from supervisor.layouts.record import Check, CheckpointRecord, TrackerStatus

__all__ = [
    "CheckpointRecord",
    "TrackerStatus",
    "Check",
    "LAYOUTS",
    "detect_layout",
    "scan",
    "latest_valid",
    "torn_newest",
    "verify_path",
    "tracker_status",
    "repair_tracker",
]

LAYOUTS: dict[str, ModuleType] = {
    "rlsup": rlsup,
    "verl": verl,
    "verl-legacy": verl,
    "megatron": megatron,
    "areal": areal,
    "nemo-rl": nemo_rl,
    "nemo": nemo,
    "hf": hf,
    "deepspeed": deepspeed,
    "lightning": lightning,
    "torchtitan": torchtitan,
    "dcp": dcp,
}
# Detection order after rlsup, verl, megatron and areal; before plain DCP (torchtitan's steps are DCP).
TRAINER_LAYOUTS: tuple[ModuleType, ...] = (nemo_rl, nemo, hf, deepspeed, lightning, torchtitan)
LAYOUT_NAMES = ("rlsup", "verl", "megatron", "areal", *(m.NAME for m in TRAINER_LAYOUTS), "dcp")
TRACKED_LAYOUTS = ("verl", "verl-legacy", "megatron", "deepspeed")


def detect_layout(directory: str | Path) -> str:
    """Which trainer wrote this checkpoint root: one of :data:`LAYOUTS`' names, or unknown."""
    root = Path(directory)
    if not root.is_dir():
        return "unknown"
    if rlsup.looks_like(root):
        return "rlsup"
    if verl.looks_like(root):
        return "verl-legacy" if verl.is_legacy_tree(root) else "verl"
    if megatron.looks_like(root):
        return "megatron"
    if areal.looks_like(root):
        return "areal"
    for mod in TRAINER_LAYOUTS:
        if mod.looks_like(root):
            return mod.NAME
    if dcp.looks_like(root):
        return "dcp"
    return "unknown"


def _resolve(root: Path, layout: str) -> ModuleType | None:
    name = detect_layout(root) if layout == "auto" else layout
    if name in ("unknown", single_file.NAME):  # single-file checkpoints have no steps (supervisor.run.file_versions)
        return None
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown layout {layout!r}; choose auto or one of {', '.join(LAYOUT_NAMES)}") from None


def scan(directory: str | Path, layout: str = "auto") -> list[CheckpointRecord]:
    """Every step under ``directory``, verified, ascending by step. Empty when nothing is recognised."""
    root = Path(directory)
    mod = _resolve(root, layout)
    if mod is None:
        return []
    ctx = mod.make_context(root)
    records = [mod.verify_step(path, step, ctx) for step, path in mod.list_steps(root)]
    return sorted(records, key=lambda r: (r.step, str(r.path)))


def latest_valid(directory: str | Path, layout: str = "auto",
                 accept: Callable[[CheckpointRecord], bool] | None = None,
                 known: KnownDigests | None = None) -> CheckpointRecord | None:
    """The newest valid step (that ``accept`` takes, when given), verifying newest-first and stopping at
    the first one. ``known``: rlsup steps' checksums already computed for unchanged files (one restart hashes
    each byte once: :class:`rlsup_format.manifest.KnownDigests`)."""
    root = Path(directory)
    mod = _resolve(root, layout)
    if mod is None:
        return None
    ctx = mod.make_context(root)
    verify = _verifier(mod, known)
    for step, path in reversed(mod.list_steps(root)):
        record = verify(path, step, ctx)
        if record.valid and (accept is None or accept(record)):
            return record
    return None


def torn_newest(directory: str | Path, layout: str = "auto", known: KnownDigests | None = None) -> list[CheckpointRecord]:
    """The invalid steps newer than the newest valid one, newest first (what a trainer that picks its
    "latest" itself would wrongly load). Verifies newest-first and stops at the first valid step (``known``: as
    for :func:`latest_valid`)."""
    root = Path(directory)
    mod = _resolve(root, layout)
    if mod is None:
        return []
    ctx = mod.make_context(root)
    verify = _verifier(mod, known)
    torn = []
    for step, path in reversed(mod.list_steps(root)):
        record = verify(path, step, ctx)
        if record.valid:
            break
        torn.append(record)
    return torn


def _verifier(mod: ModuleType, known: KnownDigests | None) -> Callable[[Path, int, object], CheckpointRecord]:
    """The layout's ``verify_step``; rlsup's with ``known`` (the one layout whose bytes are hashed)."""
    if mod is rlsup and known is not None:
        return lambda path, step, ctx: rlsup.verify_step(path, step, ctx, known=known)
    return mod.verify_step


def _unknown(path: Path, reason: str) -> CheckpointRecord:
    return CheckpointRecord(step=-1, layout="unknown", path=path, valid=False, reason=reason, size_bytes=tree_size(path))


def verify_path(path: str | Path) -> CheckpointRecord:
    """Verify one step directory of any layout (or a bare DCP directory, or an AReaL run root)."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():  # a dangling last.ckpt link is Lightning's to judge
        return _unknown(p, "does not exist")
    if not p.is_dir() and not lightning.owns(p):  # a Lightning checkpoint is one .ckpt file
        return _unknown(p, "not a directory")
    if verl.step_of(p) is not None:
        return verl.verify_step(p)
    if verl.step_of(p.parent) is not None and verl.classify_role(p) is not None:
        return verl.verify_role(p)
    if megatron.step_of(p) is not None or megatron.is_mcore_dist_dir(p):
        return megatron.verify_step(p)
    for mod in TRAINER_LAYOUTS:
        if mod.owns(p):
            return mod.verify_step(p, None, mod.make_context(p.parent))
    if rlsup.step_of(p) is not None:
        return rlsup.verify_step(p)
    if areal.looks_like(p) and (p / areal.INFO_DIR).is_dir():
        return areal.verify_step(p)
    if p.name == areal.RECOVER_DIR:
        return dcp.verify_dir(p, layout=areal.NAME, role=p.parent.name)
    if dcp.looks_like_dcp(p):
        return dcp.verify_dir(p)
    return _unknown(p, "not a checkpoint directory of a known layout")


def _find_step(root: Path, mod: ModuleType, step: int) -> Path | None:
    for s, path in mod.list_steps(root):
        if s == step:
            return path
    return None


def tracker_status(directory: str | Path) -> TrackerStatus:
    """What the root tracker claims and whether it holds (never raises on a torn tracker)."""
    root = Path(directory)
    layout = detect_layout(root)
    mod = LAYOUTS.get(layout)
    newest = latest_valid(root, layout) if mod is not None else None
    path = root / (deepspeed.LATEST if layout == deepspeed.NAME else tracker.TRACKER)
    status = TrackerStatus(
        directory=root, tracker=None, kind=layout if layout in TRACKED_LAYOUTS else None, step=None, raw=None,
        error=None, step_valid=None, step_reason="", newest_valid_step=newest.step if newest else None,
        newest_valid_path=newest.path if newest else None,
    )
    if layout == deepspeed.NAME:  # one `latest` per role (OpenRLHF); the claim names the tag's step
        claim = deepspeed.tracker_claim(root)
        if claim is None:
            return status
        status.tracker, status.step, status.raw, status.error = claim
    elif not path.exists():
        return status
    else:
        status.tracker = path
        status.step, status.raw, status.error = tracker.read_tracker(path)
    if status.error is not None or mod is None:
        if mod is None and status.error is None:
            status.step_valid, status.step_reason = False, f"layout {layout}: no steps recognised"
        return status
    step_dir = _find_step(root, mod, status.step)
    if step_dir is None:
        status.step_valid, status.step_reason = False, "its directory is gone (deleted by retention, or never made)"
        return status
    record = mod.verify_step(step_dir, status.step, mod.make_context(root))
    status.step_valid, status.step_reason = record.valid, record.reason
    if layout == megatron.NAME and record.valid:
        status.error = megatron.bridge_tracker_mismatch(root, step_dir)
    return status


class NoTrackerYet(ValueError):
    """A Megatron directory without a tracker: rlsup does not create one (the trainer starts fresh)."""


def repair_tracker(directory: str | Path, step: int) -> Path:
    """Point verl's/Megatron's ``latest_checkpointed_iteration.txt`` (DeepSpeed's ``latest``, per OpenRLHF
    role) at ``step`` atomically.

    Refuses (ValueError) unless ``step`` is a valid checkpoint here. The old content is kept as
    ``latest_checkpointed_iteration.txt.rlsup-prev``. For Megatron-Bridge runs the root
    ``latest_train_state.pt`` is also replaced by that step's ``train_state.pt``, since Bridge reads it.
    """
    root = Path(directory)
    layout = detect_layout(root)
    if layout not in TRACKED_LAYOUTS:
        raise ValueError(f"{root}: layout {layout} keeps no latest_checkpointed_iteration.txt tracker")
    mod = LAYOUTS[layout]
    step_dir = _find_step(root, mod, step)
    if step_dir is None:
        raise ValueError(f"{root}: no step {step}")
    record = mod.verify_step(step_dir, step, mod.make_context(root))
    if not record.valid:
        raise ValueError(f"{root}: step {step} is not valid ({record.reason}); refusing to point the tracker at it")
    if layout == deepspeed.NAME:  # DeepSpeed's load_checkpoint(dir) reads the tag from each save dir's `latest`
        paths = [role / deepspeed.LATEST for role in deepspeed.role_dirs(deepspeed.run_root(root))]
        tracker.write_deepspeed_latest(paths, step_dir.name)
        return paths[0]
    path = root / tracker.TRACKER
    if layout == megatron.NAME and not path.exists() and not (root / tracker.BRIDGE_TRACKER).exists():
        raise NoTrackerYet(f"{root}: Megatron keeps no tracker yet; rlsup does not create one (a Megatron-Bridge "
                         "run cut in its first save has no Bridge files yet, and Bridge cannot load that step)")
    tracker.write_tracker(path, step)
    bridge_state = step_dir / megatron.BRIDGE_TRAIN_STATE
    if layout == "megatron" and (root / tracker.BRIDGE_TRACKER).exists() and bridge_state.exists():
        tracker.copy_atomically(bridge_state, root / tracker.BRIDGE_TRACKER)
    return path
