"""A job whose checkpoints rlsup cannot read is never harmed (issue 28): the run loop, in process.

The rule (supervisor/run/progress_rule.py): with entries in checkpoint_dir that no layout reads, an attempt
made progress when the trainer's own step passed the highest step an earlier attempt reached; incidents then
say the steps lost are unknown instead of counting from scratch. An empty directory keeps the old rule: a
job that fails before its first save, every time, is a crash loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import exit_codes
from supervisor.run.progress_rule import AttemptEvidence, ProgressBasis, judge

from support.incidents import incidents
from support.fake_run_loop import Attempt, make


def _unreadable(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "weights.npz").write_bytes(b"a format no layout reads")


def test_unreadable_checkpoints_without_any_step_still_stop_a_crash_loop(tmp_path: Path) -> None:
    _unreadable(tmp_path)
    sup, layer, _ = make(tmp_path, *[Attempt(exit_code=1, beats=False)] * 3, max_no_progress_attempts=2,
                         max_restarts=10)
    assert sup.run().exit_code == exit_codes.NO_PROGRESS and len(layer.jobs) == 2


def test_an_empty_checkpoint_dir_keeps_the_crash_loop_rule(tmp_path: Path) -> None:
    sup, layer, _ = make(tmp_path, *[Attempt(exit_code=1, exit_at=4)] * 3, max_no_progress_attempts=2,
                         max_restarts=10)
    assert sup.run().exit_code == exit_codes.NO_PROGRESS and len(layer.jobs) == 2
    assert all(i.get("resume_known") is not False for i in incidents(tmp_path / "state"))


@pytest.mark.parametrize("evidence, verdict", [
    (AttemptEvidence(newest_step=10, resumed_step=10, last_step=90, unreadable=True),
     (False, ProgressBasis.CHECKPOINT)),  # a readable layout wins over printed steps
    (AttemptEvidence(newest_step=20, resumed_step=10), (True, ProgressBasis.CHECKPOINT)),
    (AttemptEvidence(new_file_versions=1), (True, ProgressBasis.FILE_VERSION)),
    (AttemptEvidence(new_file_versions=1, last_step=20), (True, ProgressBasis.FILE_VERSION)),  # the first attempt
    (AttemptEvidence(new_file_versions=1, last_step=20, high_water=20),
     (False, ProgressBasis.FILE_VERSION)),  # a re-save at the step an earlier attempt reached
    (AttemptEvidence(new_file_versions=1, last_step=21, high_water=20),
     (True, ProgressBasis.FILE_VERSION)),  # PyKEEN: one line, at its first save, past the mark (issue 41)
    (AttemptEvidence(new_file_versions=1, last_step=40, high_water=30), (True, ProgressBasis.FILE_VERSION)),
    (AttemptEvidence(new_file_versions=1, last_step=25, high_water=30),
     (False, ProgressBasis.FILE_VERSION)),  # nanoGPT re-saved the step it resumed from, and fell short
    (AttemptEvidence(new_file_versions=0, last_step=50, unreadable=True), (False, ProgressBasis.FILE_VERSION)),
    (AttemptEvidence(last_step=80, unreadable=True), (True, ProgressBasis.TRAINER_STEP)),
    (AttemptEvidence(last_step=50, high_water=50, unreadable=True), (False, ProgressBasis.TRAINER_STEP)),
    (AttemptEvidence(last_step=70, high_water=80, unreadable=True),
     (False, ProgressBasis.TRAINER_STEP)),  # below what an earlier attempt reached
    (AttemptEvidence(last_step=90, high_water=80, unreadable=True), (True, ProgressBasis.TRAINER_STEP)),
    (AttemptEvidence(last_step=51, high_water=50, unreadable=True),
     (True, ProgressBasis.TRAINER_STEP)),  # first line = last line, past the mark: progress
    (AttemptEvidence(last_step=80), (False, ProgressBasis.CHECKPOINT)),
    (AttemptEvidence(unreadable=True), (False, ProgressBasis.NOTHING)),
])
def test_one_rule_for_progress(evidence: AttemptEvidence, verdict: tuple[bool, ProgressBasis]) -> None:
    got = judge(evidence)
    assert (got.progressed, got.basis) == verdict


@pytest.mark.parametrize("printed, resumed, newest, reached", [
    (0, 10, 10, 10),  # HF's bar draws 0/N before it jumps to the resumed step; killed in between
    (14, 10, 15, 15),  # the bar lags the checkpoint it just wrote
    (23, 20, 20, 23),
    (None, 10, None, None),  # nothing reported, nothing saved: nothing to say
    (None, None, 5, 5),
])
def test_the_step_an_attempt_reached(printed: int | None, resumed: int | None, newest: int | None,
                                     reached: int | None) -> None:
    from supervisor.run.progress_rule import step_reached

    assert step_reached(printed, resumed, newest) == reached
