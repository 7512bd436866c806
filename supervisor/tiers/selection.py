"""Restart selection across checkpoint tiers: the memory tier, the local checkpoint directory and the
persistent tier.

A step in the memory tier (:mod:`supervisor.tiers.memory_tier`) is resumed from where it is, no copy: the
trainer loads it from shared memory, and its retention there never deletes the step it resumed from.
On a tie memory wins (the same step, read faster).

:func:`choose_across_tiers` picks the newest step that is valid in some tier. When the persistent
tier has a newer step than the local directory (a replaced node, a wiped local disk, a new
allocation), the step is fetched into the local checkpoint directory first, part by part through
:func:`supervisor.tiers.part_protocol.copy_part` (:meth:`supervisor.tiers.persistent.PersistentTier.fetch`), so the
trainer resumes from a local path exactly as before; a persistent copy that does not verify is
skipped and the next older one tried. On several nodes the persistent tier is one more holder in the
coordinator's plan instead (per part, :meth:`supervisor.tiers.persistent.PersistentTier.part_listing`, and
:mod:`supervisor.cluster.multinode`), and the resume point's ``tier`` names the farthest tier this node fetched
from.

Every read of the persistent tier here runs in ``PersistentTier.reads`` (:mod:`supervisor.bounded_calls`): a
listing or a fetch that has not moved for ``STALL_S`` (10 s) leaves the resume to the other tiers (local, peer,
memory) with the tier named stalled, and a read still blocked is never started twice.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

from rlsup_format.manifest import KnownDigests
from supervisor.tiers.fetch_staging import FetchTicket
from supervisor.tiers.memory_tier import MemoryTier
from supervisor.tiers.persistent import PersistentTier, PersistentTierError
from supervisor.tiers.resume import TIER_MEMORY, TIER_PERSISTENT, ResumePoint, choose_resume

log = logging.getLogger(__name__)


def iter_candidates(tier: PersistentTier, newer_than: int | None) -> Iterator[int]:
    """Persistent steps newer than ``newer_than``, newest first (names only; verified on fetch)."""
    for step in reversed(tier.steps()):
        if newer_than is not None and step <= newer_than:
            return
        yield step


def choose_across_tiers(local_dir: str | Path, persistent: PersistentTier | None, layout: str = "auto",
                        job: str | None = None, memory: MemoryTier | None = None,
                        known: KnownDigests | None = None) -> ResumePoint | None:
    """The newest valid step across tiers, fetched into ``local_dir`` when it came from the persistent tier.

    ``layout`` is the local directory's layout (``auto`` detects); the memory and persistent tiers hold
    rlsup layout steps only. None when nothing valid exists anywhere (fresh start). ``known``: the local
    directory's checksums this restart already computed (:func:`~supervisor.tiers.resume.choose_resume`).
    """
    local_dir = Path(local_dir)
    local = choose_resume(local_dir, layout, job, known)
    best = local  # tier: local
    if memory is not None and layout in ("auto", "rlsup"):
        in_memory = memory.newest_valid(full=True)
        if in_memory is not None and (best is None or in_memory[0] >= best.step):
            best = ResumePoint(in_memory[0], in_memory[1], "rlsup", TIER_MEMORY)
    if persistent is None or layout not in ("auto", "rlsup"):
        return best
    if (stalled := persistent.stalled()) is not None:  # a hung store: reading it would hold the restart too
        log.warning("persistent tier not consulted for the resume: %s", stalled)
        return best
    newer_than = best.step if best else None
    try:  # every read of the tier in a bounded call: a store that hangs right now must not hold the restart
        candidates = persistent.reads.call(lambda: list(iter_candidates(persistent, newer_than)), None)
    except OSError as e:
        log.warning("persistent tier %s unreadable: %s", persistent.location, e)
        return best
    for step in candidates or []:
        ticket = FetchTicket()  # cancelled when the call gives up: a late fetch then leaves nothing behind
        try:
            path = persistent.reads.call(lambda step=step: persistent.fetch(step, local_dir, ticket), None,
                                         progress=lambda: persistent.moved, on_give_up=ticket.cancel)
        except PersistentTierError as e:
            log.warning("persistent step %d not used: %s", step, e)
            continue
        if path is None:
            break
        log.info("step %d fetched from the persistent tier %s into %s", step, persistent.location, path)
        return ResumePoint(step, path, "rlsup", TIER_PERSISTENT)
    if (stalled := persistent.stalled()) is not None:
        log.warning("persistent tier not consulted for the resume: %s", stalled)
    return best
