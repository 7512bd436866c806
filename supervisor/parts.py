"""Checkpoint *parts*: one rank's manifest plus the files it lists, the unit that is replicated.

A part is valid when its manifest parses and every listed file matches size and checksum. Which node
owns a part (wrote it, and needs it back after a loss) is recorded by trainer_hooks in the manifest's
``extra["node_rank"]``. Reads files only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlsup_format.manifest import (
    MANIFEST_RE,
    ManifestError,
    RankManifest,
    check_files,
    list_step_dirs,
    manifest_name,
    read_manifest,
)


@dataclass(frozen=True)
class Part:
    step: int
    rank: int
    world_size: int
    owner: int | None
    step_dir: Path
    manifest: RankManifest

    @property
    def manifest_path(self) -> Path:
        return self.step_dir / manifest_name(self.rank)

    @property
    def size(self) -> int:
        return sum(e.size for e in self.manifest.files.values())


def owner_of(manifest: RankManifest) -> int | None:
    value = manifest.extra.get("node_rank")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def verify_part(step_dir: Path, rank: int, full: bool = True) -> Part | None:
    """The valid part of ``rank`` in ``step_dir``, or None (missing, torn, or not matching its files)."""
    try:
        manifest = read_manifest(step_dir / manifest_name(rank))
    except (OSError, ManifestError):
        return None
    problem, _ = check_files(step_dir, manifest.files, full=full)
    if problem or manifest.rank != rank:
        return None
    return Part(manifest.step, rank, manifest.world_size, owner_of(manifest), step_dir, manifest)


def scan_parts(root: Path, full: bool = True) -> list[Part]:
    """Every valid part in every step directory under ``root`` (rlsup layout)."""
    parts = []
    for step, step_dir in list_step_dirs(root):
        for entry in sorted(step_dir.iterdir()):
            m = MANIFEST_RE.match(entry.name)
            if m is None:
                continue
            part = verify_part(step_dir, int(m.group(1)), full=full)
            if part is not None and part.step == step:
                parts.append(part)
    return parts
