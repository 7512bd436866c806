"""Restart selection across checkpoint tiers: the local checkpoint directory and the persistent tier.

:func:`choose_across_tiers` picks the newest step that is valid in some tier. When the persistent
tier has a newer step than the local directory (a replaced node, a wiped local disk, a new
allocation), the step is fetched into the local checkpoint directory first (temp dir, verified in
full, renamed), so the trainer resumes from a local path exactly as before; a persistent copy that
does not verify is skipped and the next older one tried. Peer replicas are chosen by the multi-node
coordinator (:mod:`supervisor.multinode`); ``peers`` is the hook for a single-node caller that wants
to offer them here too. In multi-node runs the persistent tier is one more holder in the coordinator's
plan (per part, see :meth:`supervisor.persistent.PersistentTier.part_listing`), and the resume point
is a :class:`TieredResumePoint` too, naming the farthest tier this node fetched from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from supervisor.persistent import PersistentTier, PersistentTierError, iter_candidates
from supervisor.resume import ResumePoint, choose_resume

log = logging.getLogger(__name__)

TIER_LOCAL = "local"
TIER_PEER = "peer"
TIER_PERSISTENT = "persistent"


@dataclass(frozen=True)
class TieredResumePoint(ResumePoint):
    """A :class:`ResumePoint` (step, path, layout) plus the tier it came from."""

    tier: str = TIER_LOCAL


def choose_across_tiers(local_dir: str | Path, persistent: PersistentTier | None, layout: str = "auto",
                        peers: Callable[[int | None], ResumePoint | None] | None = None,
                        job: str | None = None) -> TieredResumePoint | None:
    """The newest valid step across tiers, fetched into ``local_dir`` when it came from elsewhere.

    ``layout`` is the local directory's layout (``auto`` detects); the persistent tier holds rlsup
    layout steps only. ``peers(newer_than)`` may return a newer point (already made local) from peer
    replicas; its tier is reported as ``peer``. None when nothing valid exists anywhere (fresh start).
    """
    local_dir = Path(local_dir)
    local = choose_resume(local_dir, layout, job)
    best = TieredResumePoint(local.step, local.path, local.layout, TIER_LOCAL) if local else None
    if persistent is not None and layout in ("auto", "rlsup"):
        newer_than = best.step if best else None
        try:
            candidates = list(iter_candidates(persistent, newer_than))
        except OSError as e:
            log.warning("persistent tier %s unreadable: %s", persistent.location, e)
            candidates = []
        for step in candidates:
            try:
                path = persistent.fetch(step, local_dir)
            except PersistentTierError as e:
                log.warning("persistent step %d not used: %s", step, e)
                continue
            log.info("step %d fetched from the persistent tier %s into %s", step, persistent.location, path)
            best = TieredResumePoint(step, path, "rlsup", TIER_PERSISTENT)
            break
    if peers is not None:
        point = peers(best.step if best else None)
        if point is not None and (best is None or point.step > best.step):
            best = TieredResumePoint(point.step, point.path, point.layout, TIER_PEER)
    return best
