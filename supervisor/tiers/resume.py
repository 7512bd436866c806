"""Choose the checkpoint the next attempt resumes from (the newest valid one, any supported layout)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal

if TYPE_CHECKING:
    from rlsup_format.manifest import KnownDigests
    from supervisor.tiers.memory_tier import MemoryTier

#: Where a resume point's checkpoint came from (``state.json`` ``resume_tier``, an incident's ``resumed_tier``,
#: the ``rlsup_resumes_total{tier}`` label): the memory tier, this node's checkpoint directory, another
#: node's replica, or the persistent tier.
Tier = Literal["memory", "local", "peer", "persistent"]
TIER_MEMORY: Tier = "memory"
TIER_LOCAL: Tier = "local"
TIER_PEER: Tier = "peer"
TIER_PERSISTENT: Tier = "persistent"


#: The two ways to keep a trainer that picks its own checkpoint off a torn newest one (said wherever rlsup
#: finds one, and in the hint to name the checkpoint files).
REMEDIES = ("pass --quarantine-invalid (rlsup moves a torn newest checkpoint aside before each attempt), or put a "
            "resume placeholder in the command so that the trainer loads rlsup's choice ('{resume:--resume {dir}}', "
            "or '--resume={resume?{dir}:auto}'; docs in supervisor/run/launch_args.py)")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint an attempt resumes from, and the tier it came from (always one: the local
    directory unless a tier was used, so no reader has to guess)."""

    step: int | None  # None: the checkpoint names no step (a single-file checkpoint)
    path: Path
    layout: str
    tier: Tier = TIER_LOCAL


def choose_resume(checkpoint_dir: Path, layout: str = "auto", job: str | None = None,
                  known: "KnownDigests | None" = None) -> ResumePoint | None:
    """Newest valid checkpoint under ``checkpoint_dir``, or None (a fresh start). With ``job``, an rlsup
    step whose manifest names another job is passed over: a job never resumes from another's data. ``known``:
    checksums this restart already computed, reused for files unchanged since
    (:class:`rlsup_format.manifest.KnownDigests`)."""
    if not checkpoint_dir.is_dir() or not any(checkpoint_dir.iterdir()):
        return None  # fresh start: nothing to look at
    from supervisor import layouts

    def ours(record: "layouts.CheckpointRecord") -> bool:
        return record.layout != "rlsup" or job is None or step_job(Path(record.path)) in (job, None)

    record = layouts.latest_valid(checkpoint_dir, layout=layout, accept=ours, known=known)
    if record is None:
        return None
    return ResumePoint(record.step, Path(record.path), record.layout)


def newest_step(on_disk: int | None, memory: "MemoryTier | None") -> int | None:
    """The newest valid step, the one rule on one node and on several (the progress marker a failed attempt is
    judged by): the newest step verified on disk, checksums and all, with the restart's
    :class:`~rlsup_format.manifest.KnownDigests` so that the resume choice after it hashes nothing again (one
    node: the step :func:`choose_resume` picks; several: the newest holding a valid part of this node's,
    :func:`supervisor.tiers.replication.newest_own_step`), or the memory tier's newer one (sizes: its parts
    are verified in full when chosen)."""
    in_memory = memory.newest_valid(full=False) if memory is not None else None
    if in_memory is not None and (on_disk is None or in_memory[0] > on_disk):
        return in_memory[0]
    return on_disk


def step_job(step_dir: Path) -> str | None:
    """The job rank 0's manifest of an rlsup step names (None: written without rlsup, or unreadable)."""
    from rlsup_format.manifest import ManifestError, manifest_name, read_manifest

    try:
        job = read_manifest(step_dir / manifest_name(0)).extra.get("job")
    except (OSError, ManifestError):
        return None
    return job if isinstance(job, str) else None


def repair_tracker(checkpoint_dir: Path, point: ResumePoint, log: Callable[[str], None]) -> ResumePoint | None:
    """Point an unmodified trainer's tracker (verl, Megatron, DeepSpeed) at the step rlsup chose; returns
    where the trainer will really resume: None when it will start fresh (a Megatron run with no tracker
    yet, for which rlsup creates none), so the log, state and metrics do not claim a resume."""
    from supervisor import layouts

    status = layouts.tracker_status(checkpoint_dir)
    if status.kind is None or status.ok:
        return point
    try:
        path = layouts.repair_tracker(checkpoint_dir, point.step)
    except layouts.NoTrackerYet as e:
        log(f"tracker not created: {e}; the trainer starts fresh")
        return None
    except (ValueError, OSError) as e:
        log(f"tracker not repaired: {e}")
        return point
    log(f"tracker {path} said {status.raw!r} ({status.describe()}); now points at step {point.step}")
    return point


def describe_unreadable(checkpoint_dir: Path, layout: str, single_file_tracked: bool,
                        unset_and_missing: bool = False) -> str:
    """A line for the log when rlsup cannot read the job's checkpoints (empty when it can, or when there
    are none yet): ``checkpoint_dir`` holds entries that no layout recognises, or (``unset_and_missing``)
    it is the default and does not exist after an attempt, so the checkpoints are elsewhere. What was
    found, what was tried, how to tell rlsup. Decisions then rest on the trainer's own steps
    (:mod:`supervisor.run.progress_rule`)."""
    from supervisor import layouts
    from supervisor.layouts import single_file

    if unset_and_missing and not checkpoint_dir.exists():
        return (f"checkpoint_dir {checkpoint_dir} (the default) does not exist after an attempt: rlsup sees none of the job's "
                "checkpoints, so the trainer resumes on its own, whether an attempt made progress is judged from "
                "the trainer's own steps (trainer_hooks heartbeats or --progress), and steps lost are unknown. "
                "Pass --checkpoint-dir DIR (where the trainer saves)")
    if single_file_tracked or layout not in ("auto", single_file.NAME):
        return ""  # read as single-file, or the user named a layout (its own errors say what is wrong)
    try:
        entries = sorted(p.name for p in checkpoint_dir.iterdir() if not p.name.startswith("."))
    except OSError:
        return ""
    if not entries or (layout == "auto" and layouts.detect_layout(checkpoint_dir) != "unknown"):
        return ""
    shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} in all)" if len(entries) > 5 else "")
    if layout == single_file.NAME:
        return (f"checkpoint_dir {checkpoint_dir} holds {shown}, but no complete single-file checkpoint matches "
                "checkpoint_file; set --checkpoint-file to the file the trainer saves (a name or glob). Where the "
                f"trainer then picks its own checkpoint (resume auto), to keep it off a torn newest one: {REMEDIES}")
    tried = ", ".join((*layouts.LAYOUT_NAMES, single_file.NAME))
    return (f"checkpoint_dir {checkpoint_dir} holds {shown}, which no layout recognises (tried: {tried}); rlsup "
            "cannot choose the resume point, so the trainer resumes on its own, and whether an attempt made "
            "progress is judged from the trainer's own steps (trainer_hooks heartbeats or --progress); steps lost "
            "are reported as unknown. Tell rlsup with --checkpoint-layout NAME, or --checkpoint-file GLOB for a "
            "checkpoint saved as one file (docs/layouts.md). Where the trainer then picks its own checkpoint (resume "
            f"auto), to keep it off a torn newest one: {REMEDIES}")
