"""Choose the checkpoint the next attempt resumes from (the newest valid one, any supported layout)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ResumePoint:
    step: int
    path: Path
    layout: str


def choose_resume(checkpoint_dir: Path, layout: str = "auto") -> ResumePoint | None:
    """Newest valid checkpoint under ``checkpoint_dir``, or None (a fresh start)."""
    if not checkpoint_dir.is_dir() or not any(checkpoint_dir.iterdir()):
        return None  # fresh start: nothing to look at
    from supervisor import layouts

    record = layouts.latest_valid(checkpoint_dir, layout=layout)
    if record is None:
        return None
    return ResumePoint(record.step, Path(record.path), record.layout)
