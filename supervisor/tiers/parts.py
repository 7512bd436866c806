"""Checkpoint *parts*: one rank's manifest plus the files it lists, the unit that is replicated.

A part is valid when its manifest parses and every listed file matches size and checksum. Which node
owns a part (wrote it, and needs it back after a loss) is recorded by trainer_hooks in the manifest's
``extra["node_rank"]``. Reads files only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlsup_format.manifest import KnownDigests, LocalStep, RankManifest, list_step_dirs, manifest_name
from rlsup_format.manifest import verify_part as verify_part_in
from rlsup_format.names import parse_manifest_rank, parse_step


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


def verify_part(step_dir: Path, rank: int, full: bool = True, known: KnownDigests | None = None) -> Part | None:
    """The valid part of ``rank`` in ``step_dir``, or None (missing, torn, another step's, or not
    matching its files): :func:`rlsup_format.manifest.verify_part`, the one rule. ``known``: checksums already
    computed for unchanged files (:class:`rlsup_format.manifest.KnownDigests`)."""
    step = parse_step(step_dir.name)
    if step is None:
        return None
    manifest, _ = verify_part_in(LocalStep(step_dir, known), step, rank, full)
    if manifest is None:
        return None
    return Part(manifest.step, rank, manifest.world_size, owner_of(manifest), step_dir, manifest)


def scan_parts(root: Path, full: bool = True, known: KnownDigests | None = None) -> list[Part]:
    """Every valid part in every step directory under ``root`` (rlsup layout; ``known``: as :func:`verify_part`)."""
    parts = []
    for _, step_dir in list_step_dirs(root):
        for entry in sorted(step_dir.iterdir()):
            rank = parse_manifest_rank(entry.name)
            part = verify_part(step_dir, rank, full=full, known=known) if rank is not None else None
            if part is not None:
                parts.append(part)
    return parts
