"""Did a failed attempt make progress? One rule, for the restart policy, incidents and metrics.

An attempt made progress when its trainer's newest step passed the highest step any earlier attempt of the
run completed, counted from what the attempt resumed, never from the attempt's own first line: PyKEEN prints
its progress only at its save, so an attempt killed right after its first save reports one step, its first
and its last, and that step is new. The evidence is whatever rlsup has, best first:

1. a checkpoint layout recognises the directory: its newest valid step passed the step the attempt resumed
   from (the newest valid step earlier attempts left; None: a fresh start, which any valid step passes);
2. single-file checkpoints: a new complete version of the file was kept during the attempt and, where the
   trainer reports its step, that step passed the mark: the higher of the step it resumed from (when known)
   and the highest step earlier attempts reached. A new version alone is not enough where steps are
   reported: nanoGPT re-saves the step it resumed from as it starts, and a trainer that ignores its
   checkpoint rewrites the file at the same step every attempt;
3. rlsup cannot read the checkpoints (entries no layout reads, or the default directory never appeared):
   the trainer's reported step passed the same mark. A trainer that resumes from its own checkpoints
   climbs past it; one that starts over and fails at the same point every time does not.

Otherwise (no checkpoint yet, or no step reported beside unreadable files) nothing shows progress: a job
that crashes before its first save, every time, is a crash loop.

How the attempt ended is not evidence: a hang ends an attempt as a hang and is judged on the same
evidence (a trainer that saved a new epoch and then hung made progress; one that hangs at the same step
every attempt made none).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ProgressBasis(enum.Enum):
    """What the verdict rests on."""

    CHECKPOINT = "checkpoint"  # a layout's valid steps
    FILE_VERSION = "file_version"  # complete versions of a single-file checkpoint
    TRAINER_STEP = "trainer_step"  # the trainer's own reported step
    NOTHING = "nothing"  # files no layout reads, and no step reported


@dataclass(frozen=True)
class AttemptProgress:
    """The verdict on one attempt, and what it rests on."""

    progressed: bool
    basis: ProgressBasis


@dataclass(frozen=True)
class AttemptEvidence:
    """What rlsup saw of one attempt. ``newest_step``: the newest valid step after it (None: no layout
    recognises the directory); ``resumed_step``: the step it resumed from (None: fresh, or unknown);
    ``new_file_versions``: complete single-file versions kept during it (None: no such files);
    ``unreadable``: rlsup cannot read the checkpoints; ``last_step``: the newest step the trainer reported in
    it (None: none); ``high_water``: the highest step earlier attempts of the run reached (None: none)."""

    newest_step: int | None = None
    resumed_step: int | None = None
    new_file_versions: int | None = None
    unreadable: bool = False
    last_step: int | None = None
    high_water: int | None = None


def judge(evidence: AttemptEvidence) -> AttemptProgress:
    """The rule of the module docstring."""
    if evidence.newest_step is not None:
        return AttemptProgress(_passed(evidence.newest_step, evidence.resumed_step), ProgressBasis.CHECKPOINT)
    if evidence.new_file_versions is not None:
        progressed = evidence.new_file_versions > 0
        if progressed and evidence.last_step is not None:
            progressed = _passed(evidence.last_step, mark(evidence))
        return AttemptProgress(progressed, ProgressBasis.FILE_VERSION)
    if not evidence.unreadable:
        return AttemptProgress(False, ProgressBasis.CHECKPOINT)  # no checkpoint yet
    if evidence.last_step is not None:
        return AttemptProgress(_passed(evidence.last_step, mark(evidence)), ProgressBasis.TRAINER_STEP)
    return AttemptProgress(False, ProgressBasis.NOTHING)


def mark(evidence: AttemptEvidence) -> int | None:
    """The step a reported step must pass: the higher of the step the attempt resumed from and the highest
    step earlier attempts reached (None: neither is known, so any step is new)."""
    known = [s for s in (evidence.resumed_step, evidence.high_water) if s is not None]
    return max(known) if known else None


def _passed(step: int, mark: int | None) -> bool:
    return mark is None or step > mark


def step_reached(last_step: int | None, resumed_step: int | None, newest_step: int | None) -> int | None:
    """The step an attempt really reached, for incidents, state, metrics and the progress mark: never below
    the step it resumed from (HF's bar draws ``0/N`` before it jumps to the resumed step, and a kill can land
    in between) nor below the newest valid checkpoint (a bar redrawn at most every 0.1 s lags the save)."""
    known = [s for s in (last_step, resumed_step, newest_step) if s is not None]
    if last_step is None and newest_step is None:
        return None  # no step reported and nothing saved: nothing to say (not the resumed step)
    return max(known) if known else None
