"""What rlsup can see of a job's checkpoints beyond a layout's steps, for the run loop.

Single-file checkpoints (kept aside and put back, :mod:`supervisor.run.file_versions`), torn newest
checkpoints moved aside (``quarantine_invalid``), a directory that holds what no layout reads, and the
trainer's own steps across attempts: together the evidence of :mod:`supervisor.run.progress_rule` and
whether the step an attempt resumes from is known (incidents say "unknown" where it is not).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from supervisor.run.progress_rule import AttemptEvidence, AttemptProgress, judge
from supervisor.config import DEFAULT_CHECKPOINT_DIR
from supervisor.run.file_versions import FileVersions, FileVersionSettings, LeftTorn
from supervisor.run.launch_args import picks_its_own_note, trainer_picks_its_checkpoint
from supervisor.layouts import detect_layout, single_file
from supervisor.run.quarantine import quarantine_torn, torn_newest  # at the top: launch_note runs in a forked child
from supervisor.tiers.resume import ResumePoint, describe_unreadable

if TYPE_CHECKING:
    from rlsup_format.manifest import KnownDigests
    from supervisor.config import SupervisorConfig


@dataclass(frozen=True)
class SightSettings:
    """The config's part the sight reads, built once (:meth:`from_config`); ``checkpoint_dir`` is absolute."""

    checkpoint_dir: Path
    resume: bool
    checkpoint_layout: str
    checkpoint_file: str  # single-file checkpoints: the file (or glob) the trainer saves whole; empty: every one
    quarantine_invalid: bool
    repair_tracker: bool
    file_versions: FileVersionSettings | None  # None: single-file checkpoints are not kept aside

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "SightSettings":
        """``cfg`` resolved (:meth:`SupervisorConfig.resolved`: absolute paths)."""
        return cls(Path(cfg.checkpoint_dir), cfg.resume, cfg.checkpoint_layout, cfg.checkpoint_file,
                   cfg.quarantine_invalid, cfg.repair_tracker, FileVersionSettings.from_config(cfg))


class CheckpointSight:
    """One run's view of ``settings.checkpoint_dir``. ``log`` takes rlsup's own lines. ``keep_file_versions``
    False: single-file checkpoints are never kept aside (the job's nodes would fight over one directory)."""

    def __init__(self, settings: SightSettings, log: Callable[[str], None], keep_file_versions: bool = True) -> None:
        self.settings, self.checkpoint_dir, self.log = settings, settings.checkpoint_dir, log
        self.file_versions = FileVersions(settings.checkpoint_dir, settings.file_versions) \
            if keep_file_versions and settings.file_versions is not None else None
        self.default_dir = self.checkpoint_dir == (Path.cwd() / DEFAULT_CHECKPOINT_DIR).resolve()
        self.unreadable = False  # rlsup cannot read the checkpoints (found before each attempt and after it)
        self._said = False  # ... which is said once per run
        self._attempt_ended = False  # a missing default directory tells something only after an attempt
        self._versions_at_launch = 0
        self._high_water: int | None = None  # the highest step any failed attempt of this run reached
        self.left_torn: list[LeftTorn] = []  # torn single files with no version to put back, found last
        self._torn_said: set[LeftTorn] = set()  # ... each said once per run
        self._torn_checked = False  # ... since the last attempt ended (judge's check is what restore leaves)

    def start(self) -> None:
        if self.file_versions is not None:
            self.file_versions.start()

    def stop(self) -> None:
        if self.file_versions is not None:
            self.file_versions.stop()

    # ------------------------------------------------------------ before an attempt

    def before_choosing(self, known: "KnownDigests | None" = None) -> None:
        """Single node, before the resume point is chosen: put back a torn single-file checkpoint's newest
        complete version, move torn checkpoints aside (``quarantine_invalid``; ``known``: the restart's
        checksums, :class:`rlsup_format.manifest.KnownDigests`), and say once when rlsup cannot read the
        checkpoints (decisions then rest on the trainer's own steps). A torn file with no version to put back
        is named, with why (:meth:`check_torn`)."""
        if self.file_versions is not None:
            for done in self.file_versions.restore():
                self.log(f"single-file checkpoint {done.live} is torn ({done.why}); put back its newest complete "
                         f"version ({done.version.size} bytes, saved {time.ctime(done.version.mtime_ns / 1e9)})")
            if not self._torn_checked:  # before the first attempt (after a failed one, judge has checked)
                self.check_torn()
        if self.settings.quarantine_invalid and self.settings.resume:
            for moved in quarantine_torn(self.checkpoint_dir, self.settings.checkpoint_layout,
                                         self.settings.checkpoint_file, known):
                self.log(f"quarantined {moved.source.name} ({moved.reason}) as {moved.target.name}; "
                         "put it back with mv only if you know it is good")
        self.check_unreadable()

    def check_torn(self) -> list[LeftTorn]:
        """The torn single files no kept version can replace (:attr:`left_torn`, for the failed attempt's
        incident), each said once per run: a restart then meets the torn file, or no checkpoint at all."""
        self.left_torn = self.file_versions.left_torn() if self.file_versions is not None else []
        self._torn_checked = True
        for torn in self.left_torn:
            if torn not in self._torn_said:
                self._torn_said.add(torn)
                self.log(f"single-file checkpoint {torn.live} is torn ({torn.why}) and cannot be put back: "
                         f"{torn.no_version}")
        return self.left_torn

    def single_files(self) -> bool:
        """Whether single-file checkpoints are read here (``checkpoint_layout`` single-file, or auto while no
        layout recognises the directory)."""
        if self.file_versions is None or not self.checkpoint_dir.is_dir():
            return False
        return self.settings.checkpoint_layout == single_file.NAME or detect_layout(self.checkpoint_dir) == "unknown"

    def resume_fallback(self) -> ResumePoint | None:
        """Where no layout's step was found: the newest complete single-file checkpoint, by the code
        ``rlsup checkpoints latest`` runs (it names no step: the number in a file's name is not claimed)."""
        record = single_file.latest_valid(self.checkpoint_dir, self.settings.checkpoint_file) if self.single_files() \
            else None
        return ResumePoint(None, Path(record.path), single_file.NAME) if record is not None else None

    def check_unreadable(self) -> bool:
        """Whether rlsup cannot read the job's checkpoints (said once per run, with how to fix it)."""
        read = self.single_files() and bool(single_file.checkpoint_files(self.checkpoint_dir,
                                                                         self.settings.checkpoint_file))
        said = describe_unreadable(self.checkpoint_dir, self.settings.checkpoint_layout, read,
                                   unset_and_missing=self.default_dir and self._attempt_ended)
        self.unreadable = bool(said) and self.settings.resume
        if self.unreadable and not self._said:
            self._said = True
            self.log(said)
        return self.unreadable

    def launch_note(self, command: Sequence[str], resume: ResumePoint | None) -> str:
        """What the launch line adds after rlsup's choice: where the trainer picks its own checkpoint, that it
        does, and a torn checkpoint newer than every valid one that it would load if it takes its newest
        (:func:`supervisor.run.launch_args.picks_its_own_note`). Empty where rlsup steers the trainer, or with
        ``resume`` off (the trainer chooses by the user's word). Runs in a forked child (no import here: a
        module lock another thread held at the fork would stay held)."""
        if not self.settings.resume:
            return ""
        try:
            layout = resume.layout if resume is not None else self.settings.checkpoint_layout
            if layout == "auto":
                layout = detect_layout(self.checkpoint_dir)
            if not trainer_picks_its_checkpoint(command, layout, self.settings.repair_tracker):
                return ""
            torn = torn_newest(self.checkpoint_dir, self.settings.checkpoint_layout, self.settings.checkpoint_file)
        except (OSError, ValueError):  # an unreadable directory: its own lines say so; the launch goes on
            return ""
        if resume is None and layout == "unknown" and not torn:
            return ""  # nothing here tells what the trainer is (a trainer_hooks one reads RLSUP_RESUME_DIR): no claim
        return picks_its_own_note(torn)

    def resume_known(self, resume: ResumePoint | None) -> bool:
        """Whether rlsup knows the step an attempt resumes from: not for a single-file checkpoint (no step
        in it), nor for a fresh start where it cannot read the checkpoints (the trainer may resume itself)."""
        if resume is not None:
            return resume.step is not None
        return not self.unreadable

    # ------------------------------------------------------------ during and after an attempt

    def attempt_launched(self) -> None:
        self._versions_at_launch = self.file_versions.kept if self.file_versions is not None else 0
        self._torn_checked = False

    def judge(self, last_step: int | None, newest_step: int | None, resume: ResumePoint | None) -> AttemptProgress:
        """The progress rule over a failed attempt that reached ``last_step`` (``attempt_progress.step_reached``)
        and left ``newest_step`` (the newest valid step of a layout, None when none is read); the step it
        reached is the mark later attempts must pass."""
        self._attempt_ended = True
        versions, self.left_torn = None, []
        if self.file_versions is not None and (self.file_versions.kept or self.file_versions.tracked()):
            self.file_versions.observe()  # a version completed just before the end
            versions = self.file_versions.kept - self._versions_at_launch
            self.check_torn()
        progress = judge(AttemptEvidence(newest_step=newest_step, resumed_step=resume.step if resume else None,
                                         new_file_versions=versions, unreadable=self.check_unreadable(),
                                         last_step=last_step, high_water=self._high_water))
        if last_step is not None:
            self._high_water = max(last_step, self._high_water if self._high_water is not None else -1)
        return progress
