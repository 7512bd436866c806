"""Choose the checkpoint the next attempt resumes from (the newest valid one, any supported layout)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class ResumePoint:
    step: int
    path: Path
    layout: str


def choose_resume(checkpoint_dir: Path, layout: str = "auto", job: str | None = None) -> ResumePoint | None:
    """Newest valid checkpoint under ``checkpoint_dir``, or None (a fresh start). With ``job``, an rlsup
    step whose manifest names another job is passed over: a job never resumes from another's data."""
    if not checkpoint_dir.is_dir() or not any(checkpoint_dir.iterdir()):
        return None  # fresh start: nothing to look at
    from supervisor import layouts

    def ours(record: "layouts.CheckpointRecord") -> bool:
        return record.layout != "rlsup" or job is None or step_job(Path(record.path)) in (job, None)

    record = layouts.latest_valid(checkpoint_dir, layout=layout, accept=ours)
    if record is None:
        return None
    return ResumePoint(record.step, Path(record.path), record.layout)


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
