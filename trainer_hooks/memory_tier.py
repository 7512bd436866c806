"""Where a rank's save goes when rlsup runs a memory tier: node shared memory if the step fits, else disk.

rlsup owns the tier (``memory_dir``; :mod:`supervisor.tiers.memory_tier` drains it to ``checkpoint_dir``)
and tells every rank its job's directory in ``RLSUP_MEMORY_DIR``. A save then writes the step there
with the very protocol of a disk save (:func:`trainer_hooks.step_writer.write_step`: staging, hash,
rename, manifest last), so a step in memory is valid or invalid by the same rules, and keeps
``RLSUP_MEMORY_KEEP_LAST`` steps there (the newest valid one and the one being resumed from stay).

Why a free-space check before every save: a tmpfs that fills up takes the node's RAM with it (the
OOM killer picks a rank, or the tier's writes fail half way). The check counts this rank's payload
times the ranks of this node (they save at once, into the same tmpfs), against the free space of the
filesystem and ``RLSUP_MEMORY_LIMIT_BYTES``. When the step does not fit it goes to ``checkpoint_dir``
instead, with one warning naming the bytes needed, the bytes free and the directory; the ranks
decide together (a step half in memory and half on disk would be valid nowhere).

Collective backends (``dcp``, ``megatron``) always save to disk: their files are shared by all ranks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlsup_format import job_env
from trainer_hooks.step_writer import StepTarget, all_ranks_agree, payload_bytes

log = logging.getLogger(__name__)

#: Room left beside the step itself: manifests, directory entries, rounding to pages.
MARGIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Fit:
    """The outcome of the free-space check for one save (``needed`` and ``free`` in bytes)."""

    fits: bool
    needed: int
    free: int


@dataclass(frozen=True)
class MemoryTarget:
    """The job's memory tier as rlsup described it in the environment."""

    directory: Path
    keep_last: int
    limit_bytes: int = 0

    @classmethod
    def from_env(cls, environ: Any = None) -> "MemoryTarget | None":
        """The tier rlsup set up for this attempt, or None (no memory tier)."""
        environ = os.environ if environ is None else environ
        directory = environ.get(job_env.MEMORY_DIR, "")
        if not directory:
            return None
        keep = environ.get(job_env.MEMORY_KEEP_LAST, "")
        limit = environ.get(job_env.MEMORY_LIMIT_BYTES, "")
        return cls(Path(directory), int(keep) if keep.isdigit() and int(keep) > 0 else 2,
                   int(limit) if limit.isdigit() else 0)

    def used_bytes(self) -> int:
        """Bytes of regular files under the tier's directory (what counts against ``limit_bytes``)."""
        total = 0
        for root, _dirs, files in os.walk(self.directory):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_size
                except OSError:
                    continue  # removed by retention while walking
        return total

    def free_bytes(self) -> int:
        """What the tier may still take: the filesystem's free space, capped by ``limit_bytes``."""
        st = os.statvfs(self.directory)
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
        if self.limit_bytes:
            free = min(free, max(0, self.limit_bytes - self.used_bytes()))
        return free

    def check(self, payload: Any) -> Fit:
        """Does this node's next step fit? Every rank of the node saves about this rank's payload."""
        self.directory.mkdir(parents=True, exist_ok=True)
        own = payload_bytes(payload)
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        needed = (own if own is not None else 0) * max(1, ranks_here) + MARGIN_BYTES
        free = self.free_bytes()
        return Fit(free >= needed, needed, free)

    def choose(self, step: int, payload: Any, disk: StepTarget) -> StepTarget:
        """The target of this save: the memory tier, or ``disk`` when the step does not fit here on some
        rank (a collective when a process group is initialised: all ranks choose alike)."""
        try:
            fit = self.check(payload)
        except OSError as e:
            log.warning("memory tier %s unusable (%s): step %d saved to %s instead", self.directory, e, step,
                        disk.directory)
            fit = Fit(False, 0, 0)
        if all_ranks_agree(fit.fits):
            return StepTarget(self.directory, self.keep_last, disk.resume_dir, disk_keep_last=disk.keep_last,
                              memory=True)
        if fit.fits:
            log.warning("memory tier: step %d saved to %s instead of %s: another rank's part does not fit there",
                        step, disk.directory, self.directory)
        elif fit.needed:
            log.warning("memory tier full: step %d needs about %d bytes in %s, %d bytes free there; saved to %s "
                        "instead", step, fit.needed, self.directory, fit.free, disk.directory)
        return disk
