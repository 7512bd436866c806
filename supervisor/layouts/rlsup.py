"""rlsup's own format (``step_{step:09d}/manifest.rank_{R:05d}.json``), verified by trainer_hooks.

The verifier lives in ``trainer_hooks.manifest`` (the code that writes the manifests); it is imported
lazily so this catalogue works, and says why it cannot verify, when that module is absent. Its
manifests carry checksums, so this is the one layout where shard bytes are read (``full=True``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from supervisor.layouts.files import tree_size
from supervisor.layouts.record import CheckpointRecord

NAME = "rlsup"
_FALLBACK_STEP_RE = re.compile(r"^step_(\d{9,})$")
MANIFEST_GLOB = "manifest.rank_*.json"


def _manifest_module() -> Any | None:
    try:
        from trainer_hooks import manifest  # noqa: PLC0415 - lazy on purpose
    except ImportError:
        return None
    return manifest


def _step_re() -> re.Pattern[str]:
    mod = _manifest_module()
    pattern = getattr(mod, "STEP_DIR_RE", None) if mod else None
    return re.compile(pattern) if isinstance(pattern, str) else (pattern or _FALLBACK_STEP_RE)


def step_of(path: Path) -> int | None:
    m = _step_re().match(path.name)
    return int(m.group(1)) if m else None


def list_steps(root: Path) -> list[tuple[int, Path]]:
    mod = _manifest_module()
    if mod is not None and hasattr(mod, "list_step_dirs"):
        try:
            return sorted(((int(s), Path(p)) for s, p in mod.list_step_dirs(root)), key=lambda t: t[0])
        except OSError:
            return []
    out = []
    try:
        for child in root.iterdir():
            s = step_of(child)
            if s is not None and child.is_dir():
                out.append((s, child))
    except OSError:
        return []
    return sorted(out, key=lambda t: t[0])


def looks_like(root: Path) -> bool:
    """A step directory with at least one rank manifest (an empty step_* dir alone is not enough)."""
    return any(any(p.glob(MANIFEST_GLOB)) for _, p in list_steps(root)[-3:])


def make_context(root: Path) -> None:
    return None


def verify_step(path: Path, step: int | None = None, ctx: Any = None, full: bool = True) -> CheckpointRecord:
    step = step if step is not None else step_of(path)
    mod = _manifest_module()
    if mod is None or not hasattr(mod, "verify_step_dir"):
        return CheckpointRecord(
            step=-1 if step is None else step, layout=NAME, path=path, valid=False,
            reason="trainer_hooks.manifest is not installed: cannot verify rlsup checkpoints",
            size_bytes=tree_size(path),
        )
    try:
        res = mod.verify_step_dir(path, full=full)
    except Exception as exc:  # a verifier crash must not take selection down with it
        return CheckpointRecord(
            step=-1 if step is None else step, layout=NAME, path=path, valid=False,
            reason=f"verifier error: {type(exc).__name__}: {exc}", size_bytes=tree_size(path),
        )
    notes = [f"world_size {res.world_size}"] if getattr(res, "world_size", None) else []
    rstep = getattr(res, "step", None)
    return CheckpointRecord(
        step=int(rstep) if rstep is not None else (-1 if step is None else step),
        layout=NAME,
        path=path,
        valid=bool(res.valid),
        reason=res.reason or ("complete" if res.valid else "invalid"),
        size_bytes=int(getattr(res, "size_bytes", 0) or tree_size(path)),
        notes=notes,
    )
