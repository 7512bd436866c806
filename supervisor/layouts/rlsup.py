"""rlsup's own format (``step_{step:09d}/manifest.rank_{R:05d}.json``), verified by its manifests.

The rules live in :mod:`rlsup_format.manifest`, shared with the code that writes the manifests. Its
manifests carry checksums, so this is the one layout where shard bytes are read (``full=True``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlsup_format.manifest import KnownDigests, list_step_dirs, verify_step_dir
from rlsup_format.names import parse_step
from supervisor.layouts.files import tree_size
from supervisor.layouts.record import CheckpointRecord

NAME = "rlsup"
MANIFEST_GLOB = "manifest.rank_*.json"


def step_of(path: Path) -> int | None:
    return parse_step(path.name)


def list_steps(root: Path) -> list[tuple[int, Path]]:
    return list_step_dirs(root)


def looks_like(root: Path) -> bool:
    """A step directory with at least one rank manifest (an empty step_* dir alone is not enough)."""
    return any(any(p.glob(MANIFEST_GLOB)) for _, p in list_steps(root)[-3:])


def make_context(root: Path) -> None:
    return None


def verify_step(path: Path, step: int | None = None, ctx: Any = None, full: bool = True,
                known: KnownDigests | None = None) -> CheckpointRecord:
    """``known``: checksums already computed for unchanged files (:class:`rlsup_format.manifest.KnownDigests`)."""
    step = step if step is not None else step_of(path)
    res = verify_step_dir(path, full=full, known=known)  # never raises
    notes = [f"world_size {res.world_size}"] if res.world_size else []
    return CheckpointRecord(
        step=res.step if res.step is not None else (-1 if step is None else step),
        layout=NAME,
        path=path,
        valid=res.valid,
        reason=res.reason or ("complete" if res.valid else "invalid"),
        size_bytes=res.size_bytes or tree_size(path),
        notes=notes,
    )
