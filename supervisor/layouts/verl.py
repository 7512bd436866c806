"""verl checkpoints: ``global_step_N/<role>/`` (also ``global_steps_N``, as verl's docs spell it).

A step holds one directory per trained role (actor, critic, ...); the step is usable only when
every role is complete, plus the trainer's dataloader state ``data.pt`` when the run writes one.

* Megatron engine, layout v2: ``<role>/ckpt_contents.json`` is written last; each
  ``contents[*].path`` must exist and be complete itself (``megatron_dist_checkpoint`` entries are
  MCore dist directories, ``huggingface`` entries HF export directories).
* Megatron engine before v2: a role-level ``dist_ckpt/``. verl's v2 loader rejects it, so such a
  step is reported as ``verl-legacy`` with the migration command, never as valid.
* FSDP engine: ``fsdp_config.json`` gives ``world_size``; every kind of rank file present for rank 0
  (model / optim / extra_state) must exist for all ranks and be an intact torch zip.

verl's tracker ``latest_checkpointed_iteration.txt`` is written with a plain ``open("w")`` after the
save: it can be torn, can name a step that ``max_*_ckpt_to_keep`` deleted, and FSDP async saves may
never write it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from supervisor.layouts import dcp, megatron
from supervisor.layouts.files import check_hf_dir, check_zip, read_json, step_dirs, tree_size
from supervisor.layouts.record import Check, CheckpointRecord

NAME = "verl"
LEGACY = "verl-legacy"
STEP_RE = re.compile(r"^global_steps?_(\d+)$")
TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "ckpt_contents.json"
FSDP_CONFIG = "fsdp_config.json"
DATALOADER = "data.pt"
KNOWN_ROLES = frozenset({"actor", "critic", "ref", "reward", "rm", "reward_model", "actor_rollout_ref", "rollout"})
RANK_FILE_RE = re.compile(r"^(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")
MIGRATION_HINT = (
    "pre-v2 verl Megatron layout (role-level dist_ckpt/); the v2 loader rejects it. Migrate with "
    "`python scripts/migrate_megatron_checkpoint_layout.py --checkpoint {role}` "
    "(or --checkpoint-root <run> --all-steps)"
)


@dataclass
class VerlContext:
    """Run-wide facts: whether this run's trainer writes ``data.pt`` into each step."""

    expects_dataloader: bool


def classify_role(role_dir: Path) -> str | None:
    """'megatron', 'legacy', 'fsdp', 'partial' (a known role name, nothing recognisable) or None."""
    if (role_dir / MANIFEST).exists():
        return "megatron"
    if (role_dir / "dist_ckpt").is_dir():
        return "legacy"
    if (role_dir / FSDP_CONFIG).exists() or any(RANK_FILE_RE.match(p.name) for p in _files(role_dir)):
        return "fsdp"
    if any((role_dir / d).is_dir() for d in ("model", "optimizer", "extra")):
        return "megatron"
    if role_dir.name in KNOWN_ROLES:
        return "partial"
    return None


def _files(directory: Path) -> list[Path]:
    try:
        return [p for p in directory.iterdir() if p.is_file()]
    except OSError:
        return []


def check_fsdp_role(role_dir: Path) -> Check:
    config, err = read_json(role_dir / FSDP_CONFIG)
    if err:
        if "missing" in err:
            err += " (rank 0 writes it after its shards: killed mid-save, or a verl too old to write it)"
        return Check.bad(err)
    try:
        world = int(config["world_size"])
        assert world >= 1
    except (KeyError, TypeError, ValueError, AssertionError):
        return Check.bad(f"{FSDP_CONFIG} has no usable world_size")
    present: dict[tuple[str, int], set[int]] = {}
    for p in _files(role_dir):
        m = RANK_FILE_RE.match(p.name)
        if m:
            present.setdefault((m.group(1), int(m.group(2))), set()).add(int(m.group(3)))
    kinds = sorted(k for (k, w), ranks in present.items() if w == world and 0 in ranks)
    notes = []
    stale = sorted({w for (_, w) in present if w != world})
    if stale:
        notes.append(f"rank files for other world sizes {stale} ignored")
    if not kinds:
        return Check.bad(f"no rank-0 model/optim/extra_state files for world_size {world} (nothing resumable)", notes)
    if "model" not in kinds:
        notes.append("no model shards: save_contents lacked 'model'")
    for kind in kinds:
        have = present[(kind, world)]
        missing = [r for r in range(world) if r not in have]
        if missing:
            return Check.bad(f"{kind} shards missing for ranks {missing[:8]} of {world}", notes)
        for r in range(world):
            c = check_zip(role_dir / f"{kind}_world_size_{world}_rank_{r}.pt")
            if not c.ok:
                return Check.bad(c.reason, notes)
            notes.extend(c.notes)
    hf = role_dir / "huggingface"
    if hf.is_dir() and (any(hf.glob("*.safetensors")) or any(hf.glob("*.index.json"))):
        c = check_hf_dir(hf, need_weights=True)
        if not c.ok:
            return Check.bad(f"hf_model export: {c.reason}", notes)
    return Check.good(notes)


def _check_content(role_dir: Path, name: str, entry: dict) -> Check:
    rel = entry.get("path")
    if not isinstance(rel, str) or not rel:
        return Check.bad(f"{MANIFEST}: contents[{name!r}] has no path")
    target = (role_dir / rel)
    if not target.exists():
        return Check.bad(f"{MANIFEST}: contents[{name!r}] path {rel} missing")
    fmt = entry.get("format")
    if fmt == "megatron_dist_checkpoint":
        if megatron.is_mcore_dist_dir(target):
            return megatron.check_mcore_dist(target)
        return dcp.check_dcp(target)
    if fmt == "huggingface":
        return check_hf_dir(target, need_weights=name in ("model", "hf_model"))
    if fmt == "json":
        _, err = read_json(target)
        return Check.bad(err) if err else Check.good()
    return Check.good([f"contents[{name!r}] format {fmt!r}: existence checked only"])


def check_megatron_role(role_dir: Path, step: int | None) -> Check:
    manifest, err = read_json(role_dir / MANIFEST)
    if err:
        if "missing" in err:
            err += " (written last: save killed before it finished)"
        return Check.bad(err)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("contents"), dict):
        return Check.bad(f"{MANIFEST} has no contents map")
    notes: list[str] = []
    if manifest.get("schema_version") != 2:
        notes.append(f"{MANIFEST} schema_version {manifest.get('schema_version')!r}, expected 2")
    gs = manifest.get("global_step")
    if step is not None and gs is not None and gs != step:
        return Check.bad(f"{MANIFEST} says global_step {gs} but the directory is step {step} (moved or mixed)")
    checked: set[tuple[str, str]] = set()
    for name, entry in manifest["contents"].items():
        if not isinstance(entry, dict):
            return Check.bad(f"{MANIFEST}: contents[{name!r}] is not an object")
        key = (str(entry.get("path")), str(entry.get("format")))
        if key in checked and name not in ("model", "hf_model"):
            continue
        checked.add(key)
        c = _check_content(role_dir, name, entry)
        if not c.ok:
            return Check.bad(f"{name}: {c.reason}", notes)
        notes.extend(c.notes)
    for rel in (manifest.get("directories") or {}):
        if not (role_dir / rel).exists():
            return Check.bad(f"{MANIFEST} lists directory {rel} which is missing", notes)
    return Check.good(notes)


def list_steps(root: Path) -> list[tuple[int, Path]]:
    return step_dirs(root, step_of)


def looks_like(root: Path) -> bool:
    return bool(list_steps(root))


def step_of(path: Path) -> int | None:
    m = STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def make_context(root: Path) -> VerlContext:
    return VerlContext(expects_dataloader=any((p / DATALOADER).exists() for _, p in list_steps(root)))


def is_legacy_tree(root: Path) -> bool:
    """True when the newest step's roles are all pre-v2 Megatron."""
    steps = list_steps(root)
    if not steps:
        return False
    kinds = {classify_role(r) for r in _role_dirs(steps[-1][1])}
    kinds.discard(None)
    return kinds == {"legacy"}


def _role_dirs(step_dir: Path) -> list[Path]:
    try:
        return sorted(p for p in step_dir.iterdir() if p.is_dir())
    except OSError:
        return []


def check_role(role_dir: Path, step: int | None) -> tuple[str | None, Check]:
    kind = classify_role(role_dir)
    if kind == "megatron":
        return kind, check_megatron_role(role_dir, step)
    if kind == "fsdp":
        return kind, check_fsdp_role(role_dir)
    if kind == "legacy":
        return kind, Check.bad(MIGRATION_HINT.format(role=role_dir))
    if kind == "partial":
        return kind, Check.bad(f"no {MANIFEST} or {FSDP_CONFIG} (killed before the role was written)")
    return kind, Check.good([f"{role_dir.name}/ is not a role directory; ignored"])


def verify_step(path: Path, step: int | None = None, ctx: VerlContext | None = None) -> CheckpointRecord:
    step = step if step is not None else step_of(path)
    ctx = ctx or make_context(path.parent)
    notes: list[str] = []
    layout = NAME
    valid, reason = True, "complete"
    roles = []
    for role_dir in _role_dirs(path):
        kind, check = check_role(role_dir, step)
        notes.extend(f"{role_dir.name}: {n}" for n in check.notes)
        if kind is None:
            continue
        roles.append(role_dir.name)
        if kind == "legacy":
            layout = LEGACY
        if not check.ok and valid:
            valid, reason = False, f"{role_dir.name}: {check.reason}"
    if not roles:
        valid, reason = False, "no role directories (killed before any role was saved)"
    if valid:
        data = path / DATALOADER
        if data.exists():
            c = check_zip(data)
            if not c.ok:
                valid, reason = False, f"dataloader state {c.reason}"
        elif ctx.expects_dataloader:
            valid, reason = False, f"{DATALOADER} missing while other steps have it (killed before the trainer wrote it)"
        else:
            notes.append(f"no {DATALOADER}: dataloader position will not be restored")
    if roles:
        notes.insert(0, f"roles: {', '.join(roles)}")
    return CheckpointRecord(
        step=-1 if step is None else step,
        layout=layout,
        path=path,
        valid=valid,
        reason=reason,
        size_bytes=tree_size(path),
        notes=notes,
    )


def verify_role(role_dir: Path) -> CheckpointRecord:
    """One role directory on its own (``global_step_N/actor``)."""
    step = step_of(role_dir.parent)
    kind, check = check_role(role_dir, step)
    if kind is None:
        check = Check.bad("not a verl role directory (no ckpt_contents.json, fsdp_config.json or rank files)")
    return CheckpointRecord(
        step=-1 if step is None else step,
        layout=LEGACY if kind == "legacy" else NAME,
        path=role_dir,
        valid=check.ok,
        reason=check.reason or "complete",
        size_bytes=tree_size(role_dir),
        role=role_dir.name,
        notes=check.notes,
    )
