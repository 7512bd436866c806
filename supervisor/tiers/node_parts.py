"""A node's own parts of a step: what "valid" means for one node's memory tier on several nodes.

On one node a step directory holds every rank's part, and a step is valid by the manifest rule for the
whole step. On several nodes a node's memory tier (and its checkpoint directory) holds only the parts
its own ranks wrote: such a step is never valid as a whole there, yet the drainer, retention and an
in-place resume all need to know whether *this node's* share of it is. :meth:`NodeParts.whole` answers
that: every part of this node's ranks is valid here and belongs to this job.

A node's ranks are torchrun's contiguous block of ``world / nodes`` ranks (rank pinning launches each
node with ``node_rank * nproc_per_node + local_rank``; the coordinator's plan assumes the same block
for parts that record no node). When the world does not divide evenly the block is unknown: then the
parts whose manifests name this node stand in for it, except where a wrong guess could cost a valid
step (``strict``: retention, an in-place resume), which then does not happen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rlsup_format.manifest import KnownDigests, LocalStep, ManifestError, RankManifest, read_manifest, verify_part
from rlsup_format.names import manifest_name, parse_manifest_rank, parse_step
from supervisor.tiers.parts import owner_of


@dataclass(frozen=True)
class NodeParts:
    """Which parts are this node's (``node`` of ``nodes``), and which job's parts count (None: any)."""

    node: int = 0
    nodes: int = 1
    job: str | None = None

    def ranks(self, world: int) -> set[int] | None:
        """This node's ranks in a world of ``world``: all of them on one node, torchrun's contiguous
        block on several; None when the block is unknown (the world does not divide evenly)."""
        if self.nodes <= 1:
            return set(range(world))
        if world <= 0 or world % self.nodes:
            return None
        per = world // self.nodes
        return set(range(self.node * per, (self.node + 1) * per))

    def accept(self, manifest: RankManifest) -> str:
        """"" for a part of this job (or one that names no job), else why it must not be used."""
        job = manifest.extra.get("job")
        if self.job and isinstance(job, str) and job != self.job:
            return f"written by job {job!r}, this is job {self.job!r}"
        return ""

    def valid_parts(self, step_dir: Path, full: bool = True, known: KnownDigests | None = None
                    ) -> dict[int, RankManifest]:
        """Every valid part of this job in ``step_dir``, by rank (whoever's it is); ``known``: checksums computed
        earlier in this restart, reused for files unchanged since."""
        step = parse_step(step_dir.name)
        if step is None:
            return {}
        reader = LocalStep(step_dir, known)
        out = {}
        for rank in _manifest_ranks(step_dir):
            m, _ = verify_part(reader, step, rank, full)
            if m is not None and not self.accept(m):
                out[rank] = m
        return out

    def whole(self, step_dir: Path, full: bool = True, strict: bool = False, known: KnownDigests | None = None
              ) -> dict[int, RankManifest] | None:
        """This node's parts of the step in ``step_dir`` when every one of them is valid (and this job's);
        else None. ``strict``: None when this node's ranks are unknown (see the module docstring); ``known``: as
        :meth:`valid_parts`."""
        step = parse_step(step_dir.name)
        world = _world_size(step_dir)
        if step is None or world is None:
            return None
        expected = self.ranks(world)
        if expected is None and strict:
            return None
        reader = LocalStep(step_dir, known)
        if expected is None:  # an uneven world: the valid parts that name this node
            found = {r: m for r, m in self.valid_parts(step_dir, full, known).items() if owner_of(m) == self.node}
            return found if found and all(m.world_size == world for m in found.values()) else None
        parts = {}
        for rank in sorted(expected):
            m, _ = verify_part(reader, step, rank, full)
            if m is None or m.world_size != world or self.accept(m):
                return None
            parts[rank] = m
        return parts or None


def _manifest_ranks(step_dir: Path) -> list[int]:
    try:
        names = os.listdir(step_dir)
    except OSError:
        return []
    return sorted(r for n in names if (r := parse_manifest_rank(n)) is not None)


def _world_size(step_dir: Path) -> int | None:
    """The world size the first readable manifest in ``step_dir`` records (None: no manifest reads)."""
    for rank in _manifest_ranks(step_dir):
        try:
            return read_manifest(step_dir / manifest_name(rank)).world_size
        except (OSError, ManifestError):
            continue
    return None
