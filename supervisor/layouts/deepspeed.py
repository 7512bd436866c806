"""DeepSpeed ``engine.save_checkpoint(save_dir, tag)`` trees (``global_stepN/`` + ``latest``), and
OpenRLHF's form of them (``<ckpt_path>/_actor/`` and ``<ckpt_path>/_critic/``, each a save_dir).

Write order (deepspeed 0.19.8, ``deepspeed/runtime/engine.py``, ``save_checkpoint``): rank 0 makes
``save_dir``; barrier; every rank makes ``<tag>/``; the model-states writer of each model-parallel
rank ``torch.save``s ``mp_rank_XX_model_states.pt`` (ZeRO-3: every data-parallel rank writes
``zero_pp_rank_D_mp_rank_XX_model_states.pt``; pipeline engines first write ``layer_NN-*model_states.pt``
from ``module_state_dict``); every data-parallel rank then writes its optimizer shard
``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt`` (``_save_zero_checkpoint``) and rank 0 copies
``zero_to_fp32.py``; ``checkpoint_engine.commit`` (a no-op for the torch engine) and rank 0 overwrites
``latest`` IN PLACE with ``open('w')`` -- all *before* the final ``dist.barrier()``. So ``latest`` can
name a tag whose other ranks have not finished their shards, and ``latest`` itself can be empty.
There is no commit marker: a tag is complete when every file its ranks write is present and intact.

Files only: zips are checked through their central directory; the one pickle read (the ``data.pkl``
member of rank 0's model states, for ``dp_world_size``/``mp_world_size``/ZeRO stage) goes through a
restricted unpickler that stubs torch/DeepSpeed classes and never touches tensor storage.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from supervisor.layouts.files import check_zip, tree_size
from supervisor.layouts.inert_pickle import PLAIN, InertUnpickler
from supervisor.layouts.record import Check, CheckpointRecord
from supervisor.layouts.tracker import read_stripped

NAME = "deepspeed"
LATEST = "latest"
ROLE_DIRS = ("_actor", "_critic")
STEP_RE = re.compile(r"^global_step(\d+)$")  # verl's global_step_N (underscore) never matches
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
LAYER_RE = re.compile(r"^layer_\d+-.*model_states\.pt$")
MAX_PICKLE = 256 * 1024 * 1024

# modules whose globals get an inert stub (never imported, never called); anything else is refused
_STUB_PREFIXES = ("torch", "deepspeed", "numpy", "collections", "argparse", "enum", "openrlhf", "transformers",
                  "peft", "_codecs", "datetime", "pathlib")


class _Dict(dict):
    """OrderedDict stand-in that takes the attributes a state_dict pickles (``_metadata``)."""


_REAL = {**PLAIN, ("collections", "OrderedDict"): _Dict, ("torch", "Size"): tuple}


def _stubbed(module: str, name: str) -> bool:
    return module.split(".")[0] in _STUB_PREFIXES


@dataclass
class RankMeta:
    """What rank 0's model-states pickle says about the run that wrote the tag."""

    dp_world_size: int
    mp_world_size: int
    zero_stage: int
    bf16: bool
    global_steps: int | None
    pipeline: bool


@dataclass
class DsContext:
    """Run-wide facts: the run root, its roles (OpenRLHF) and, once a pipeline tag asks, the layer files
    seen per role (listing every tag is left until then: most runs have no pipeline)."""

    root: Path
    roles: list[Path]
    layer_names: dict[str, set[str]] = field(default_factory=dict)

    def layers(self, role: Path) -> set[str]:
        """Every pipeline ``layer_*`` file name any tag of ``role`` holds."""
        if role.name not in self.layer_names:
            names: set[str] = set()
            for tag in _tags(role).values():
                names.update(n for n in _names(role / tag) if LAYER_RE.match(n))
            self.layer_names[role.name] = names
        return self.layer_names[role.name]


def role_dirs(root: Path) -> list[Path]:
    """OpenRLHF's ``_actor``/``_critic`` save dirs when present, else the root itself."""
    roles = [root / r for r in ROLE_DIRS if (root / r).is_dir()]
    return roles or [root]


def run_root(path: Path) -> Path:
    """The run root of a save dir or role dir (``_actor`` -> its parent)."""
    if path.name in ROLE_DIRS and path.parent.is_dir():
        return path.parent
    return path


def _dirs(directory: Path) -> list[Path]:
    try:
        with os.scandir(directory) as it:
            return [Path(e.path) for e in it if e.is_dir()]
    except OSError:
        return []


def _names(directory: Path) -> list[str]:
    try:
        with os.scandir(directory) as it:
            return sorted(e.name for e in it)
    except OSError:
        return []


def read_latest(path: Path) -> tuple[str | None, str | None, str | None]:
    """(tag, raw, error) of a ``latest`` file, read as DeepSpeed does (``read().strip()``); never raises."""
    tag, raw, error = read_stripped(path, "empty (rank 0 was killed inside its in-place open('w'))")
    if tag is None:
        return None, raw, error
    if "/" in tag or "\n" in tag or tag in (".", ".."):
        return None, raw, f"not a tag name: {tag[:40]!r}"
    return tag, raw, None


def tag_step(name: str) -> int | None:
    """Step of a tag: N of ``global_stepN``, else the last number in a custom tag; None without one."""
    m = STEP_RE.match(name)
    if m:
        return int(m.group(1))
    m = _LAST_NUMBER.search(name)
    return int(m.group(1)) if m else None


def _tags(save_dir: Path) -> dict[int, str]:
    """step -> tag directory name in one save dir: ``global_stepN`` dirs plus the tag ``latest`` names."""
    found = {int(m.group(1)): d.name for d in _dirs(save_dir) if (m := STEP_RE.match(d.name))}
    tag, _, err = read_latest(save_dir / LATEST)
    if err is None and tag is not None and tag not in found.values() and (save_dir / tag).is_dir():
        step = tag_step(tag)
        if step is not None and step not in found:
            found[step] = tag
    return found


def _is_save_dir(directory: Path) -> bool:
    return (directory / LATEST).is_file() or any(STEP_RE.match(d.name) for d in _dirs(directory))


def looks_like(root: Path) -> bool:
    """A DeepSpeed save dir (``latest`` or ``global_stepN/``), or an OpenRLHF root with ``_actor/``."""
    if (root / ROLE_DIRS[0]).is_dir():
        return True
    return _is_save_dir(root)


def owns(path: Path) -> bool:
    """A tag directory: the one its parent's ``latest`` names, or a ``global_stepN`` beside a ``latest``
    or holding model states (a tag killed right after its mkdir is still one, and invalid)."""
    if not path.is_dir() or tag_step(path.name) is None:
        return False
    tag, _, err = read_latest(path.parent / LATEST)
    if err is None and tag == path.name:
        return True
    if STEP_RE.match(path.name) is None:
        return False
    return (path.parent / LATEST).is_file() or any(MODEL_RE.match(n) for n in _names(path))


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """Ascending (step, tag dir of the first role that has it); a step of any role counts."""
    roles = role_dirs(run_root(root))
    steps: dict[int, Path] = {}
    for role in roles:
        for step, tag in _tags(role).items():
            steps.setdefault(step, role / tag)
    return sorted(steps.items())


def make_context(root: Path) -> DsContext:
    """Roles of the run (OpenRLHF's ``_actor``/``_critic``, else the save dir itself)."""
    top = run_root(root)
    return DsContext(root=top, roles=role_dirs(top))


def _read_pickle(path: Path) -> tuple[Any, str | None]:
    """The top-level object of a torch.save zip's ``data.pkl``, tensors as placeholders."""
    try:
        with zipfile.ZipFile(path) as zf:
            members = [i for i in zf.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if not members:
                return None, f"{path.name} has no data.pkl"
            info = min(members, key=lambda i: i.filename.count("/"))
            if info.file_size > MAX_PICKLE:
                return None, f"{path.name}: data.pkl is {info.file_size} bytes, not read"
            data = zf.read(info)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as exc:
        return None, f"{path.name} unreadable ({exc})"
    try:
        return InertUnpickler(data, _REAL, _stubbed).load(), None
    except pickle.UnpicklingError as exc:
        return None, f"{path.name}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a torn pickle is a failed check, never a crash
        return None, f"{path.name}: data.pkl is torn ({type(exc).__name__}: {exc})"


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def read_meta(model_states: Path) -> tuple[RankMeta | None, str | None]:
    """(meta, None) or (None, why) from ``mp_rank_00_model_states.pt`` (ZeRO-3: rank 0's file)."""
    state, err = _read_pickle(model_states)
    if err:
        return None, err
    if not isinstance(state, dict) or "dp_world_size" not in state:
        return None, f"{model_states.name} holds no dp_world_size (not DeepSpeed model states)"
    config = state.get("ds_config") if isinstance(state.get("ds_config"), dict) else {}
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    stage = zero.get("stage", 0)
    bf16 = config.get("bf16") if isinstance(config.get("bf16"), dict) else {}
    steps = state.get("global_steps")
    return RankMeta(
        dp_world_size=_int(state.get("dp_world_size"), 1),
        mp_world_size=_int(state.get("mp_world_size"), 1),
        zero_stage=stage if isinstance(stage, int) and not isinstance(stage, bool) else 0,
        bf16=bool(bf16.get("enabled", False)),
        global_steps=steps if isinstance(steps, int) else None,
        pipeline="module" in state and state["module"] is None,
    ), None


def _fallback_meta(names: list[str]) -> RankMeta:
    """World sizes guessed from the files present (used only when the pickle cannot be read)."""
    dp = max([int(m.group(2)) for n in names if (m := OPTIM_RE.match(n))] or [0]) + 1
    mp = max([int(m.group(2)) for n in names if (m := MODEL_RE.match(n))] or [0]) + 1
    stage3 = any((m := MODEL_RE.match(n)) and m.group(1) is not None for n in names)
    return RankMeta(dp, mp, 3 if stage3 else 0, any(n.startswith("bf16_") for n in names), None, False)


def _expected(meta: RankMeta, names: list[str]) -> tuple[list[str], list[str]]:
    """(model-states files, optimizer shards) this tag must hold, from the world sizes."""
    dp, mp = meta.dp_world_size, meta.mp_world_size
    if meta.zero_stage >= 3:
        models = [f"zero_pp_rank_{d}_mp_rank_{m:02d}_model_states.pt" for m in range(mp) for d in range(dp)]
    else:
        models = [f"mp_rank_{m:02d}_model_states.pt" for m in range(mp)]
    has_optim = any(OPTIM_RE.match(n) for n in names)
    if meta.zero_stage == 0 and not meta.bf16 and not has_optim:
        return models, []  # no ZeRO: the optimizer state lives inside the model states
    prefix = "bf16_" if any(n.startswith("bf16_") and OPTIM_RE.match(n) for n in names) else ""
    optim = [f"{prefix}zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for m in range(mp) for d in range(dp)]
    return models, optim


def _missing(kind: str, need: list[str], have: set[str], meta: RankMeta, source: str) -> Check | None:
    gone = [n for n in need if n not in have]
    if not gone:
        return None
    return Check.bad(f"{kind} {gone[0]} missing: {len(need) - len(gone)} of {len(need)} present "
                     f"(dp_world_size {meta.dp_world_size}, mp_world_size {meta.mp_world_size}, "
                     f"ZeRO stage {meta.zero_stage}, from {source}); a rank died before its torch.save")


def check_tag(tag_dir: Path, known_layers: Callable[[], set[str]] | None = None) -> Check:
    """Every file the save of this tag writes is present and an intact torch zip. ``known_layers``
    gives the pipeline layer files other tags of the run hold (asked only for pipeline tags)."""
    if not tag_dir.is_dir():
        return Check.bad(f"{tag_dir.name}/ missing")
    names = _names(tag_dir)
    have = set(names)
    models = [n for n in names if MODEL_RE.match(n)]
    if not models:
        return Check.bad(f"{tag_dir.name}/ has no mp_rank_XX_model_states.pt (killed before the model states)")
    head = "mp_rank_00_model_states.pt" if "mp_rank_00_model_states.pt" in have else \
        "zero_pp_rank_0_mp_rank_00_model_states.pt"
    first = check_zip(tag_dir / head)
    if not first.ok:
        return Check.bad(first.reason)
    notes: list[str] = []
    meta, err = read_meta(tag_dir / head)
    source = head
    if meta is None:
        notes.append(f"world sizes guessed from the files present: {err}")
        meta, source = _fallback_meta(names), "the files present"
    need_models, need_optim = _expected(meta, names)
    for kind, need in (("model states", need_models), ("optimizer shard", need_optim)):
        bad = _missing(kind, need, have, meta, source)
        if bad is not None:
            return Check.bad(bad.reason, notes)
    pipeline = meta.pipeline or any(LAYER_RE.match(n) for n in names)
    lost = sorted(known_layers() - have) if pipeline and known_layers is not None else []
    if lost:
        return Check.bad(f"pipeline layer file {lost[0]} missing ({len(lost)} of the layer files other tags hold)",
                         notes)
    if meta.pipeline and not any(LAYER_RE.match(n) for n in names):
        return Check.bad("pipeline model states (module None) but no layer_*-model_states.pt files", notes)
    for n in names:
        if n.endswith(".pt") and n != head:
            c = check_zip(tag_dir / n)
            if not c.ok:
                return Check.bad(c.reason, notes)
            notes.extend(c.notes)
    step = tag_step(tag_dir.name)
    if meta.global_steps is not None and STEP_RE.match(tag_dir.name) and step != meta.global_steps:
        notes.append(f"{head} says global_steps {meta.global_steps}, the tag says {step}")
    return Check.good(notes)


def verify_step(path: Path, step: int | None = None, ctx: DsContext | None = None) -> CheckpointRecord:
    """One tag of every role of the run (OpenRLHF: ``_actor`` and ``_critic`` must both hold it)."""
    tag = path.name
    if step is None:
        step = tag_step(tag) if tag_step(tag) is not None else -1
    if ctx is None or path.parent not in ctx.roles:
        ctx = make_context(path.parent)
    dirs = [role / tag for role in ctx.roles] if path.parent in ctx.roles else [path]
    size = sum(tree_size(d) for d in dirs)
    notes: list[str] = []
    for d in dirs:
        role = d.parent.name if d.parent.name in ROLE_DIRS else None
        c = check_tag(d, lambda role_dir=d.parent: ctx.layers(role_dir))
        notes.extend(f"{role}: {n}" if role else n for n in c.notes)
        if not c.ok:
            where = f"{role}/{tag}" if role else tag
            return CheckpointRecord(step=step, layout=NAME, path=path, valid=False, reason=f"{where}: {c.reason}",
                                    size_bytes=size, role=role, notes=notes)
    return CheckpointRecord(step=step, layout=NAME, path=path, valid=True, reason="", size_bytes=size, notes=notes)


def latest_claims(root: Path) -> list[tuple[Path, str | None, str | None, str | None]]:
    """(latest path, tag, raw, error) for every role's save dir, in role order."""
    return [(role / LATEST, *read_latest(role / LATEST)) for role in role_dirs(run_root(root))]


def tracker_claim(root: Path) -> tuple[Path, int | None, str | None, str | None] | None:
    """(latest path, step, raw, error) for the run's ``latest`` file(s); None when no role has one.

    OpenRLHF keeps one ``latest`` per role: a role without one, or roles naming different tags, is an
    error (DeepSpeed would resume the actor and the critic from different steps)."""
    claims = latest_claims(root)
    if all(err == "missing" for _, _, _, err in claims):
        return None
    top = run_root(root)
    for path, _, raw, err in claims:
        if err is not None:
            return path, None, raw, f"{path.relative_to(top)} {err}"
    tags = {tag for _, tag, _, _ in claims}
    path, tag, raw, _ = claims[0]
    if len(tags) > 1:
        said = ", ".join(f"{p.relative_to(top)} names {t}" for p, t, _, _ in claims)
        return path, None, raw, f"roles disagree: {said}"
    step = tag_step(str(tag))
    if step is None:
        return path, None, raw, f"names tag {tag!r}, which has no step number"
    return path, step, raw, None
