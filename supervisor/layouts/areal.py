"""AReaL recover checkpoints: ``recover_info/`` plus ``<role>/recover_checkpoint/`` (DCP).

AReaL keeps exactly one recover checkpoint and overwrites it in place: the engine's DCP save
first, then ``recover_info/`` (``step_info.json`` and the saver/evaluator/stats/dataloader states).
So a torn DCP means there is nothing valid at all, and the step is whatever ``step_info.json`` says.

Detectable here: a missing/torn ``step_info.json``; state files older than it (a dump killed after
``step_info.json``); a DCP whose ``.metadata`` is missing, torn, or
lists shards that are missing or too short; shards newer than their ``.metadata`` (an overwrite in
progress or killed); a ``.metadata`` newer than ``step_info.json`` (weights of a newer save under
the old step's metadata: killed between the DCP save and the recover_info dump).

Not detectable without checksums: new shard bytes written over old ones of exactly the same size
whose mtimes do not betray them (coarse-mtime filesystems, clocks set back, copies that reset mtimes).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from supervisor.layouts import dcp, megatron
from supervisor.layouts.files import read_json, tree_size
from supervisor.layouts.record import Check, CheckpointRecord

NAME = "areal"
INFO_DIR = "recover_info"
STEP_INFO = "step_info.json"
RECOVER_DIR = "recover_checkpoint"
JSON_INFOS = ("saver_info.json", "evaluator_info.json", "stats_logger_info.json", "checkpoint_info.json")
DATALOADER_INFO = "dataloader_info.pkl"


def role_dirs(root: Path) -> list[Path]:
    """Each model's directory (``default``, ``actor``, ...). Not ``recover_info``: AReaL's launcher, in
    ``check_if_auto_recover``, asks every directory of the save root for its recover path, which creates
    an empty ``recover_info/recover_checkpoint/`` at each start with ``recover.mode=auto``."""
    try:
        return sorted(p for p in root.iterdir() if p.is_dir() and p.name != INFO_DIR and (p / RECOVER_DIR).is_dir())
    except OSError:
        return []


def looks_like(root: Path) -> bool:
    return (root / INFO_DIR).is_dir() or bool(role_dirs(root))


def parse_step(info: Any) -> int | None:
    """``global_step`` of StepInfo as AReaL dumps it (flat, or under ``last_step_info``)."""
    if isinstance(info, dict):
        for candidate in (info, info.get("last_step_info")):
            if isinstance(candidate, dict) and isinstance(candidate.get("global_step"), int):
                return candidate["global_step"]
    return None


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """One entry at most: AReaL keeps a single recover checkpoint."""
    if not looks_like(root):
        return []
    info, _ = read_json(root / INFO_DIR / STEP_INFO)
    step = parse_step(info)
    return [(-1 if step is None else step, root)]


def _check_pickle_header(path: Path) -> Check:
    """The dataloader pickle must at least be non-empty and end with STOP; not unpickled (unsafe)."""
    try:
        size = path.stat().st_size
        if size == 0:
            return Check.bad(f"{path.name} is empty")
        with open(path, "rb") as fh:
            fh.seek(size - 1)
            if fh.read(1) != pickle.STOP:
                return Check.bad(f"{path.name} truncated (no pickle STOP opcode at end)")
    except FileNotFoundError:
        return Check.good([f"{path.name} absent"])
    except OSError as exc:
        return Check.bad(f"{path.name} unreadable: {exc}")
    return Check.good()


def _older_than_step_info(info_dir: Path) -> list[str]:
    """The state files an interrupted dump left from the save before: ``RecoverInfo.dump`` writes
    ``step_info.json`` first, then every other file, each time (areal/utils/recover.py)."""
    try:
        step_ns = (info_dir / STEP_INFO).stat().st_mtime_ns
    except OSError:
        return []
    stale = []
    for name in (*JSON_INFOS, DATALOADER_INFO):
        try:
            if (info_dir / name).stat().st_mtime_ns < step_ns:
                stale.append(name)
        except FileNotFoundError:
            continue
    return stale


def check_recover(root: Path) -> tuple[int | None, Check]:
    info_dir = root / INFO_DIR
    info, err = read_json(info_dir / STEP_INFO)
    if err:
        return None, Check.bad(f"{INFO_DIR}/{err}")
    step = parse_step(info)
    if step is None:
        return None, Check.bad(f"{INFO_DIR}/{STEP_INFO} has no integer global_step")
    notes: list[str] = []
    for name in JSON_INFOS:
        if (info_dir / name).exists():
            _, e = read_json(info_dir / name)
            if e:
                return step, Check.bad(f"{INFO_DIR}/{e}")
    c = _check_pickle_header(info_dir / DATALOADER_INFO)
    if not c.ok:
        return step, Check.bad(f"{INFO_DIR}/{c.reason}")
    notes.extend(c.notes)
    stale = _older_than_step_info(info_dir)
    if stale:
        return step, Check.bad(f"{INFO_DIR}/{', '.join(stale)} older than {STEP_INFO} (killed while dumping "
                               f"recover_info: step {step} with an earlier save's states)")
    roles = role_dirs(root)
    if not roles:
        return step, Check.bad(f"no <role>/{RECOVER_DIR}/ next to {INFO_DIR}/")
    step_info_ns = (info_dir / STEP_INFO).stat().st_mtime_ns
    for role in roles:
        ckpt = role / RECOVER_DIR
        if megatron.is_mcore_dist_dir(ckpt):
            rc = megatron.check_mcore_dist(ckpt)
        else:
            rc = dcp.check_dcp(ckpt)
        if not rc.ok:
            return step, Check.bad(f"{role.name}/{RECOVER_DIR}: {rc.reason} (the only copy: nothing valid)", notes)
        notes.extend(f"{role.name}: {n}" for n in rc.notes)
        newer = dcp.shards_newer_than_metadata(ckpt)
        if newer:
            return step, Check.bad(
                f"{role.name}/{RECOVER_DIR}: shards {newer[:3]} newer than .metadata (overwrite in progress or killed)",
                notes,
            )
        meta_ns = (ckpt / dcp.METADATA).stat().st_mtime_ns
        if meta_ns > step_info_ns:
            return step, Check.bad(
                f"{role.name}/{RECOVER_DIR} was saved after {STEP_INFO} (weights of a newer save under step {step}'s"
                " metadata: killed before recover_info was dumped)",
                notes,
            )
    notes.append(f"roles: {', '.join(r.name for r in roles)}")
    return step, Check.good(notes)


def make_context(root: Path) -> None:
    return None


def verify_step(path: Path, step: int | None = None, ctx: Any = None) -> CheckpointRecord:
    s, check = check_recover(path)
    size = sum(tree_size(p) for p in [path / INFO_DIR, *(r / RECOVER_DIR for r in role_dirs(path))])
    return CheckpointRecord.of_check(check, step=s, layout=NAME, path=path, size_bytes=size)
