"""What rlsup can see of a job's checkpoints beyond a layout's steps, for the run loop.

Single-file checkpoints (kept aside and put back, :mod:`supervisor.file_versions`), torn newest
checkpoints moved aside (``quarantine_invalid``), a directory that holds what no layout reads, and the
trainer's own steps across attempts: together the evidence of :mod:`supervisor.attempt_progress` and
whether the step an attempt resumes from is known (incidents say "unknown" where it is not).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from supervisor.attempt_progress import AttemptEvidence, AttemptProgress, judge
from supervisor.config import DEFAULT_CHECKPOINT_DIR
from supervisor.file_versions import FileVersions
from supervisor.tiers.resume import ResumePoint, describe_unreadable

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig


class CheckpointSight:
    """One run's view; ``cfg`` is resolved (absolute paths). ``log`` takes rlsup's own lines."""

    def __init__(self, cfg: "SupervisorConfig", checkpoint_dir: Path, log: Callable[[str], None],
                 keep_file_versions: bool = True) -> None:
        self.cfg, self.checkpoint_dir, self.log = cfg, checkpoint_dir, log
        self.file_versions = FileVersions.from_config(cfg, checkpoint_dir) if keep_file_versions else None
        self.default_dir = checkpoint_dir == (Path.cwd() / DEFAULT_CHECKPOINT_DIR).resolve()
        self.unreadable = False  # rlsup cannot read the checkpoints (found before each attempt and after it)
        self._said = False  # ... which is said once per run
        self._attempt_ended = False  # a missing default directory tells something only after an attempt
        self._versions_at_launch = 0
        self._first_step: int | None = None  # the first step the trainer reported in this attempt
        self._high_water: int | None = None  # the highest step any failed attempt of this run reported

    def start(self) -> None:
        if self.file_versions is not None:
            self.file_versions.start()

    def stop(self) -> None:
        if self.file_versions is not None:
            self.file_versions.stop()

    # ------------------------------------------------------------ before an attempt

    def before_choosing(self) -> None:
        """Single node, before the resume point is chosen: put back a torn single-file checkpoint's newest
        complete version, move torn checkpoints aside (``quarantine_invalid``), and say once when rlsup
        cannot read the checkpoints (decisions then rest on the trainer's own steps)."""
        if self.file_versions is not None:
            for done in self.file_versions.restore():
                self.log(f"single-file checkpoint {done.live} is torn ({done.why}); put back its newest complete "
                         f"version ({done.version.size} bytes, saved {time.ctime(done.version.mtime_ns / 1e9)})")
        if self.cfg.quarantine_invalid and self.cfg.resume:
            from supervisor.quarantine import quarantine_torn

            for moved in quarantine_torn(self.checkpoint_dir, self.cfg.checkpoint_layout, self.cfg.checkpoint_file):
                self.log(f"quarantined {moved.source.name} ({moved.reason}) as {moved.target.name}; "
                         "put it back with mv only if you know it is good")
        self.check_unreadable()

    def resume_fallback(self) -> ResumePoint | None:
        """Where no layout's step was found: the newest complete single-file checkpoint (it names no step)."""
        live = self.file_versions.newest_valid() if self.file_versions is not None else None
        return ResumePoint(None, live, "single-file") if live is not None else None

    def check_unreadable(self) -> bool:
        """Whether rlsup cannot read the job's checkpoints (said once per run, with how to fix it)."""
        said = describe_unreadable(self.checkpoint_dir, self.cfg.checkpoint_layout,
                                   self.file_versions is not None and bool(self.file_versions.tracked()),
                                   unset_and_missing=self.default_dir and self._attempt_ended)
        self.unreadable = bool(said) and self.cfg.resume
        if self.unreadable and not self._said:
            self._said = True
            self.log(said)
        return self.unreadable

    def resume_known(self, resume: ResumePoint | None) -> bool:
        """Whether rlsup knows the step an attempt resumes from: not for a single-file checkpoint (no step
        in it), nor for a fresh start where it cannot read the checkpoints (the trainer may resume itself)."""
        if resume is not None:
            return resume.step is not None
        return not self.unreadable

    # ------------------------------------------------------------ during and after an attempt

    def attempt_launched(self) -> None:
        self._versions_at_launch = self.file_versions.kept if self.file_versions is not None else 0
        self._first_step = None

    def step_seen(self, step: int | None) -> None:
        """The trainer's last step moved (the run loop's poll)."""
        if self._first_step is None:
            self._first_step = step

    def judge(self, last_step: int | None, newest_step: int | None, resume: ResumePoint | None) -> AttemptProgress:
        """The progress rule over a failed attempt that reported ``last_step`` and left ``newest_step``
        (the newest valid step of a layout, None when none is read)."""
        self._attempt_ended = True
        versions = None
        if self.file_versions is not None and (self.file_versions.kept or self.file_versions.tracked()):
            self.file_versions.observe()  # a version completed just before the end
            versions = self.file_versions.kept - self._versions_at_launch
        progress = judge(AttemptEvidence(newest_step=newest_step, resumed_step=resume.step if resume else None,
                                         new_file_versions=versions, unreadable=self.check_unreadable(),
                                         first_step=self._first_step, last_step=last_step,
                                         high_water=self._high_water))
        if last_step is not None:
            self._high_water = max(last_step, self._high_water if self._high_water is not None else -1)
        return progress
