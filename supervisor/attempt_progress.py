"""Did a failed attempt make progress? One rule, for the restart policy, incidents and metrics.

rlsup prefers what it can verify: a newer valid checkpoint than the one the attempt resumed from.
Where it cannot read the trainer's checkpoints, judging by them would punish a healthy job (every
attempt "made no new valid checkpoint", backoff grows, exit 76 while the trainer saved fine), so it
falls back to what it can still see, in this order:

1. a checkpoint layout recognises the directory: a valid step newer than the resumed one;
2. single-file checkpoints: a new complete version of the file was kept during the attempt (and, where
   the trainer reports its step, that step passed the mark of 3: nanoGPT re-saves the step it resumed
   from as it starts, which is not a newer checkpoint);
3. rlsup cannot read the checkpoints (entries no layout reads, or the default directory never
   appeared): the trainer's own step (heartbeats or output progress) moved past both the step it
   started the attempt from and the highest step any earlier attempt of the run reached. A trainer
   that resumes from its own checkpoints climbs past that mark; one that starts over and fails at
   the same point every time does not.

Otherwise (no checkpoint yet, or no step reported beside unreadable files) nothing shows progress: a
job that crashes before its first save, every time, is a crash loop.
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
    ``unreadable``: rlsup cannot read the checkpoints; ``first_step``/``last_step``: the first and last
    step the trainer reported in it; ``high_water``: the highest step earlier attempts of the run reported."""

    newest_step: int | None = None
    resumed_step: int | None = None
    new_file_versions: int | None = None
    unreadable: bool = False
    first_step: int | None = None
    last_step: int | None = None
    high_water: int | None = None


def judge(evidence: AttemptEvidence) -> AttemptProgress:
    """The rule of the module docstring."""
    if evidence.newest_step is not None:
        progressed = evidence.resumed_step is None or evidence.newest_step > evidence.resumed_step
        return AttemptProgress(progressed, ProgressBasis.CHECKPOINT)
    if evidence.new_file_versions is not None:
        progressed = evidence.new_file_versions > 0
        if progressed and evidence.first_step is not None and evidence.last_step is not None:
            progressed = _past_mark(evidence)  # a re-save of the resumed step at start is not a newer one
        return AttemptProgress(progressed, ProgressBasis.FILE_VERSION)
    if not evidence.unreadable:
        return AttemptProgress(False, ProgressBasis.CHECKPOINT)  # no checkpoint yet
    if evidence.first_step is not None and evidence.last_step is not None:
        return AttemptProgress(_past_mark(evidence), ProgressBasis.TRAINER_STEP)
    return AttemptProgress(False, ProgressBasis.NOTHING)


def _past_mark(evidence: AttemptEvidence) -> bool:
    """The trainer's step passed the one it started from and the run's high-water mark."""
    assert evidence.first_step is not None and evidence.last_step is not None
    mark = max(evidence.first_step, evidence.high_water if evidence.high_water is not None else -1)
    return evidence.last_step > mark


def step_reached(last_step: int | None, resumed_step: int | None, newest_step: int | None) -> int | None:
    """The step a failed attempt really reached, for incidents and metrics: never below the step it
    resumed from (HF's bar draws ``0/N`` before it jumps to the resumed step, and a kill can land in
    between) nor below the newest valid checkpoint (a bar redrawn at most every 0.1 s lags the save)."""
    known = [s for s in (last_step, resumed_step, newest_step) if s is not None]
    if last_step is None and newest_step is None:
        return None  # no step reported and nothing saved: nothing to say (not the resumed step)
    return max(known) if known else None
