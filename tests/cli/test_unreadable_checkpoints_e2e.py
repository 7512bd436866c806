"""The end-to-end half of test_unreadable_checkpoints.py (real processes, or waits on real time): a job whose
checkpoints rlsup cannot read is never harmed (issue 28): the run loop, in process."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from supervisor import exit_codes
from supervisor.cli.incidents import incident_line, report, steps_lost

from support.incidents import incidents
from support.fake_run_loop import Attempt, make
from test_unreadable_checkpoints import _unreadable




def test_steps_that_move_beside_unreadable_checkpoints_are_progress(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    _unreadable(tmp_path)
    climbing = [Attempt(exit_code=1, exit_at=4, step_base=2 * k) for k in range(4)]  # resumes, 2 steps further
    sup, layer, _ = make(tmp_path, *climbing, Attempt(exit_code=0), max_no_progress_attempts=2, max_restarts=10,
                         backoff_initial=5.0)
    with caplog.at_level(logging.INFO, logger="supervisor"):
        result = sup.run()
    assert result.exit_code == exit_codes.OK and len(layer.jobs) == 5  # never 76, never backed off 5 s
    said = [r.getMessage() for r in caplog.records if "no layout recognises" in r.getMessage()]
    assert len(said) == 1 and "weights.npz" in said[0] and "--checkpoint-layout" in said[0]
    assert "--checkpoint-file" in said[0] and "--quarantine-invalid" in said[0] and "{resume:" in said[0]  # both remedies
    recorded = incidents(tmp_path / "state")
    assert [i["action"] for i in recorded] == ["restart"] * 4
    assert all(i["resume_known"] is False and steps_lost(i) is None for i in recorded)
    assert all(i["downtime_s"] < 5.0 for i in recorded)  # each restart at once: backoff_initial 5 s never used
    assert "steps lost unknown" in incident_line(recorded[0])
    assert "downtime" in report(tmp_path / "state", recorded) and ", steps lost unknown" in report(
        tmp_path / "state", recorded)  # never "0 steps lost"
    assert "unknown for 4 more" in report(tmp_path / "state", [{"last_step": 9, "resumed_step": 4, "downtime_s": 1.0}, *recorded])


def test_a_trainer_that_starts_over_and_fails_at_the_same_step_is_not_progress(tmp_path: Path) -> None:
    _unreadable(tmp_path)  # steps 1..3 in every attempt: never past the first attempt's mark
    sup, layer, _ = make(tmp_path, *[Attempt(exit_code=1, exit_at=4)] * 4, max_no_progress_attempts=2,
                         max_restarts=10)
    assert sup.run().exit_code == exit_codes.NO_PROGRESS and len(layer.jobs) == 3


def test_a_default_checkpoint_dir_that_never_appears_falls_back_to_the_trainers_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)  # checkpoint_dir stays the default ./checkpoints; the trainer saves elsewhere
    climbing = [Attempt(exit_code=1, exit_at=4, step_base=2 * k) for k in range(3)]
    sup, layer, _ = make(tmp_path, *climbing, Attempt(exit_code=0), max_no_progress_attempts=2, max_restarts=10,
                         checkpoint_dir="checkpoints")
    with caplog.at_level(logging.INFO, logger="supervisor"):
        assert sup.run().exit_code == exit_codes.OK and len(layer.jobs) == 4
    said = [r.getMessage() for r in caplog.records if "(the default) does not exist" in r.getMessage()]
    assert len(said) == 1 and "--checkpoint-dir" in said[0]
    assert not (tmp_path / "checkpoints").exists()


