"""PyTorch Lightning checkpoints: ``*.ckpt`` files (``epoch=E-step=S.ckpt``, ``last.ckpt``) or
``*.ckpt`` directories written by the FSDP / ModelParallel (sharded) and DeepSpeed strategies.

The root is ``ModelCheckpoint``'s ``dirpath`` (by default ``<default_root_dir>/lightning_logs/
version_N/checkpoints``). Because Lightning's default logger opens a new ``version_N`` on every
restart, a root that holds ``version_*/checkpoints/`` (or ``lightning_logs/version_*/checkpoints/``)
is read across all versions.

Commit points (lightning 2.6.6, fsspec 2026.9.0):

* a file: ``lightning/fabric/utilities/cloud_io.py::_atomic_save`` serialises into memory, then
  writes through ``fs.transaction``: fsspec's ``LocalFileOpener`` writes a ``tempfile.mkstemp()``
  file in ``$TMPDIR`` and ``commit()`` moves it onto the final name with ``shutil.move``. On one
  filesystem that is an atomic ``rename``; when ``$TMPDIR`` is another filesystem it is a *copy
  into the final name* (a kill leaves a torn ``.ckpt``). Older Lightning wrote in place.
* ``save_last="link"``: ``ModelCheckpoint._link_checkpoint`` removes ``last.ckpt``, then symlinks it
  (a kill between leaves no ``last.ckpt``); ``save_last=True`` saves a full copy (same transaction).
* sharded FSDP (``lightning/pytorch/strategies/fsdp.py::save_checkpoint``): ``mkdir``, a DCP save
  (``.metadata`` last), then rank 0 ``torch.save(..., meta.pt)`` in place: ``meta.pt`` is the commit.
* DeepSpeed (``lightning/pytorch/strategies/deepspeed.py::save_checkpoint`` -> deepspeed 0.19.8
  ``engine.save_checkpoint(tag="checkpoint")``): ``checkpoint/*model_states.pt`` and
  ``*optim_states.pt``, then the ``latest`` file (plain ``open("w")``): ``latest`` is the commit.

Pickles are read with :mod:`supervisor.layouts.inert_pickle`: no tensor storage is touched (persistent ids
become placeholders) and no global is imported except ``collections.OrderedDict`` and a few builtins; every
other class or function named in the pickle becomes an inert stub.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path
from typing import Any

from supervisor.layouts import dcp
from supervisor.layouts.files import check_zip, tree_size
from supervisor.layouts.inert_pickle import PLAIN, InertUnpickler, Stub
from supervisor.layouts.record import Check, CheckpointRecord

NAME = "lightning"
SUFFIX = ".ckpt"
FSDP_META = "meta.pt"  # lightning/fabric/utilities/load.py: _METADATA_FILENAME
DS_LATEST = "latest"
STEP_RE = re.compile(r"(?:^|[-_ ])step=(\d+)")
LAST_RE = re.compile(r"^last")  # ModelCheckpoint._find_last_checkpoints: re.match(r"^last(-(\d+))?", stem)
DS_MODEL_RE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")
DS_OPTIM_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def _any(module: str, name: str) -> bool:
    return True  # a Lightning checkpoint may name any class: each is an inert stub


def read_checkpoint_dict(path: Path) -> tuple[dict | None, str | None]:
    """(top-level dict, None) or (None, why) for a torch.save zip; never raises."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith("data.pkl")]
            if not names:
                return None, f"{path.name} has no data.pkl"
            data = zf.read(min(names, key=len))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError) as exc:
        return None, f"{path.name}: data.pkl unreadable ({type(exc).__name__}: {exc})"
    try:
        obj = InertUnpickler(data, PLAIN, _any, storage=Stub("storage")).load()
    except Exception as exc:  # noqa: BLE001 - a torn pickle is an expected outcome, not a crash
        return None, f"{path.name}: data.pkl is torn or corrupt ({type(exc).__name__}: {exc})"
    if not isinstance(obj, dict):
        return None, f"{path.name}: top level is {type(obj).__name__}, not a checkpoint dict"
    return obj, None


def _global_step(state: dict, path: Path) -> tuple[int | None, str | None]:
    step = state.get("global_step")
    if isinstance(step, bool) or not isinstance(step, int):
        return None, f"{path.name}: no integer global_step in the checkpoint dict"
    return step, None


def step_from_name(path: Path) -> int | None:
    """``S`` of ``step=S`` in the name (ModelCheckpoint's default ``epoch=E-step=S``): no file read."""
    m = STEP_RE.search(path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.name)
    return int(m.group(1)) if m else None


def is_last(path: Path) -> bool:
    """A ``last*.ckpt`` name, as ModelCheckpoint's own ``ckpt_path="last"`` lookup matches it."""
    return bool(LAST_RE.match(path.name))


def kind_of(path: Path) -> str:
    """'link' (symlink), 'file', 'fsdp' (sharded dir), 'deepspeed' (dir) or 'dir' (unrecognised dir)."""
    if path.is_symlink():
        return "link"
    if path.is_dir():
        if (path / DS_LATEST).exists() or any(path.glob("*/*model_states.pt")):
            return "deepspeed"
        if (path / FSDP_META).exists() or dcp.looks_like_dcp(path):
            return "fsdp"
        return "dir"
    return "file"


def check_file(path: Path, need_state_dict: bool = True) -> tuple[Check, int | None]:
    """A ``.ckpt`` file: intact zip whose pickle is a dict with ``global_step`` (and, for a file fit can
    resume from, ``state_dict`` and ``optimizer_states``)."""
    zcheck = check_zip(path)
    if not zcheck.ok:
        return zcheck, None
    if zcheck.notes:  # legacy non-zip pickle: cannot parse safely, trust the name
        return zcheck, step_from_name(path)
    state, err = read_checkpoint_dict(path)
    if err:
        return Check.bad(err), None
    step, err = _global_step(state, path)
    if err:
        return Check.bad(err), None
    if need_state_dict and "state_dict" not in state:
        return Check.bad(f"{path.name}: checkpoint dict has no state_dict"), step
    if need_state_dict and "optimizer_states" not in state:  # checkpoint_connector.py raises KeyError on it
        return Check.bad(f"{path.name}: weights-only checkpoint (save_weights_only=True); "
                         "trainer.fit(ckpt_path=...) cannot resume from it"), step
    return Check.good(), step


def check_fsdp_dir(path: Path) -> tuple[Check, int | None]:
    """Sharded FSDP/ModelParallel: DCP complete, then ``meta.pt`` (written last) intact with global_step."""
    meta = path / FSDP_META
    dcheck = dcp.check_dcp(path)
    if not dcheck.ok:
        return Check.bad(f"{path.name}/{dcheck.reason}"), None
    if not meta.exists():
        return Check.bad(f"{path.name}/{FSDP_META} missing (rank 0 writes it after the DCP shards)"), None
    mcheck, step = check_file(meta, need_state_dict=False)
    if not mcheck.ok:
        return Check.bad(f"{path.name}/{mcheck.reason}"), None
    newer = dcp.shards_newer_than_metadata(path)
    if newer:
        return Check.bad(f"{path.name}: shards {newer[:3]} newer than .metadata (re-save in place unfinished)"), step
    try:
        if (path / dcp.METADATA).stat().st_mtime_ns > meta.stat().st_mtime_ns:
            return Check.bad(f"{path.name}: .metadata newer than {FSDP_META} (re-save in place unfinished)"), step
    except OSError as exc:
        return Check.bad(f"{path.name}: {exc}"), step
    return Check(True, "", dcheck.notes + mcheck.notes), step


def _read_latest(path: Path) -> tuple[str | None, str | None]:
    try:
        tag = (path / DS_LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None, f"{path.name}/{DS_LATEST} missing (DeepSpeed writes it after every rank file)"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path.name}/{DS_LATEST} unreadable: {exc}"
    if not tag:
        return None, f"{path.name}/{DS_LATEST} is empty (torn write)"
    return tag, None


def check_deepspeed_dir(path: Path) -> tuple[Check, int | None]:
    """DeepSpeed: ``latest`` names a tag dir whose model-state files are intact (global_step in the
    rank-0 one) and whose optimizer shards exist for every data-parallel rank the model states name."""
    tag, err = _read_latest(path)
    if err:
        return Check.bad(err), None
    tag_dir = path / tag
    files = sorted(p for p in tag_dir.glob("*.pt")) if tag_dir.is_dir() else []
    models = [p for p in files if DS_MODEL_RE.search(p.name)]
    if not models:
        return Check.bad(f"{path.name}/{tag}/ has no *model_states.pt (latest names a missing save)"), None
    for f in files:
        zcheck = check_zip(f)
        if not zcheck.ok:
            return Check.bad(f"{path.name}/{tag}/{zcheck.reason}"), None
    state, err = read_checkpoint_dict(models[0])
    if err:
        return Check.bad(f"{path.name}/{tag}/{err}"), None
    step, err = _global_step(state, models[0])
    if err:
        return Check.bad(f"{path.name}/{tag}/{err}"), None
    world = state.get("dp_world_size")
    optims = {int(m.group(1)) for p in files if (m := DS_OPTIM_RE.search(p.name))}
    if optims and isinstance(world, int) and world > 0:
        missing = sorted(set(range(world)) - optims)
        if missing:
            return Check.bad(f"{path.name}/{tag}/: optimizer shards of dp ranks {missing[:5]} missing "
                             f"(dp_world_size {world})"), step
    notes = [] if optims else ["no *optim_states.pt (weights-only or ZeRO off)"]
    return Check.good(notes), step


def _checkpoint_dirs(root: Path) -> list[Path]:
    """The root plus every ``version_*/checkpoints`` under it (a new version per restart)."""
    dirs = [root]
    for pattern in ("version_*/checkpoints", "lightning_logs/version_*/checkpoints"):
        try:
            dirs.extend(sorted(p for p in root.glob(pattern) if p.is_dir()))
        except OSError:
            continue
    return dirs


def _entries(directory: Path) -> list[tuple[Path, bool]]:
    """``(path, is_symlink)`` of every ``*.ckpt`` entry, from one directory scan (no per-file stat)."""
    try:
        with os.scandir(directory) as it:
            return [(Path(e.path), e.is_symlink()) for e in it if e.name.endswith(SUFFIX)]
    except OSError:
        return []


def looks_like(root: Path) -> bool:
    """A directory holding ``*.ckpt`` files or directories (itself or in ``version_*/checkpoints``)."""
    return any(_entries(d) for d in _checkpoint_dirs(root))


def owns(path: Path) -> bool:
    """A ``.ckpt`` file, symlink or strategy directory."""
    return path.name.endswith(SUFFIX) and (path.is_symlink() or path.exists())


def _listed_step(path: Path) -> int:
    """Cheap step for ordering: the name's ``step=S``; else the pickle's global_step (-1 when torn)."""
    named = step_from_name(path)
    if named is not None:
        return named
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        return step_from_name(target) if step_from_name(target) is not None else -1
    kind = kind_of(path)
    _, step = (check_file(path) if kind == "file" else check_fsdp_dir(path) if kind == "fsdp"
               else check_deepspeed_dir(path) if kind == "deepspeed" else (None, None))
    return -1 if step is None else step


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """Every ``.ckpt`` entry, ascending by step; at one step ``last*`` sorts first so that the named
    file (checked first by newest-first selection) is preferred. A ``last.ckpt`` symlink to a listed
    file is dropped (same checkpoint)."""
    entries: list[tuple[Path, bool]] = []
    real: set[str] = set()
    for d in _checkpoint_dirs(root):
        found = _entries(d)
        entries.extend(found)
        base = os.path.realpath(d)
        real.update(os.path.join(base, p.name) for p, link in found if not link)
    keyed = []
    for p, link in entries:
        if link and os.path.realpath(p) in real:
            continue
        keyed.append((_listed_step(p), 0 if is_last(p) else 1, str(p), p))
    keyed.sort(key=lambda t: t[:3])
    return [(step, p) for step, _, _, p in keyed]


def make_context(root: Path) -> None:
    """No run-wide hints: every Lightning checkpoint carries its own step and strategy files."""
    return None


def verify_step(path: Path, step: int | None = None, ctx: Any = None) -> CheckpointRecord:
    """Record for one ``.ckpt`` entry; its step is the checkpoint's own global_step when readable."""
    notes: list[str] = []
    target = path
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        notes.append(f"symlink to {target}")
        if not target.exists():
            check, found = Check.bad(f"{path.name} is a dangling symlink (to {os.readlink(path)})"), None
            return _record(path, step, found, check, notes)
    kind = kind_of(target)
    if kind == "file":
        check, found = check_file(target)
    elif kind == "fsdp":
        check, found = check_fsdp_dir(target)
    elif kind == "deepspeed":
        check, found = check_deepspeed_dir(target)
    else:
        check, found = Check.bad(f"{path.name}/ is a directory without meta.pt, DCP files or DeepSpeed latest"), None
    notes.append(f"kind: {kind}")
    named = step_from_name(target)
    if check.ok and named is not None and found is not None and named != found:
        notes.append(f"name says step {named}, checkpoint global_step is {found}")
    return _record(path, step, found, check, notes)


def _record(path: Path, step: int | None, found: int | None, check: Check, notes: list[str]) -> CheckpointRecord:
    if step is None or step < 0:  # listed without a step (a link or copy without step=S in its name)
        step = found if found is not None else (step_from_name(path) if step_from_name(path) is not None else -1)
    return CheckpointRecord(step=step, layout=NAME, path=path, valid=check.ok, reason=check.reason or "complete",
                            size_bytes=tree_size(path), notes=notes + check.notes)
