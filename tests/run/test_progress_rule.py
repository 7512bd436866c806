"""Issue 41's progress rule and the record after giving up, in process: the real run loop, file versions,
progress rule, restart policy and incidents over the fake process layer, around a fake trainer of PyKEEN's
shape (supervisor/run/progress_rule.py says the rule).

PyKEEN resumes from its one checkpoint file by itself, rewrites it in place after each epoch and prints its
progress only at that save: an attempt killed right after its first save reports one step, its first and its
last. It made progress all the same (a new file version, at a step past the highest an earlier attempt
reached), so six such kills in a row finish the run; a real crash loop still ends in 76, with a last
incident that says it gave up (no resume, no steps lost) and names a torn file no version can replace.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from supervisor.cli.incidents import incident_line, steps_lost



def test_an_incident_no_attempt_followed_claims_no_resume() -> None:
    """As rlsup wrote a give-up before issue 41 (``resume_known`` true, no resumed step, no downtime): the
    listing said "5 steps lost (step 5 -> resumed from scratch)" although nothing was resumed."""
    from supervisor.cli.incidents import summarize

    legacy = {"time": 0, "attempt": 5, "reason": "signal", "action": "no_progress", "last_step": 5,
              "resume_known": True, "resumed_step": None, "downtime_s": None}
    line = incident_line(legacy)
    assert steps_lost(legacy) is None and "gave up at step 5" in line and "resumed" not in line and "lost" not in line
    assert summarize([legacy]).steps_lost == 0
    restarted = {**legacy, "action": "restart", "resumed_step": 3, "downtime_s": 1.5}
    assert steps_lost(restarted) == 2 and "2 steps lost (step 5 -> resumed 3)" in incident_line(restarted)
    stopped = {**legacy, "action": "stop", "last_step": None}
    assert "stopped" in incident_line(stopped) and steps_lost(stopped) is None


def test_saves_closer_than_a_copy_leave_a_torn_file_named_with_that_reason(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every complete save is rewritten while rlsup copies it (saves milliseconds apart), so no version is
    kept; a kill then tears the file: what rlsup could not put back says why."""
    import shutil

    from supervisor.run.file_versions import FileVersions, FileVersionSettings

    live = tmp_path / "ckpt.pt"
    data = pickle.dumps({"epoch": 1, "weights": list(range(1000))})
    live.write_bytes(data)

    def copy_while_the_trainer_saves_again(src: Path, dest: Path, link: bool) -> None:
        shutil.copyfile(src, dest)
        live.write_bytes(pickle.dumps({"epoch": 2, "weights": list(range(1000))}))

    monkeypatch.setattr(FileVersions, "_materialise", staticmethod(copy_while_the_trainer_saves_again))
    versions = FileVersions(tmp_path, FileVersionSettings("ckpt.pt", auto=False))
    assert versions.observe() == 0 and versions.versions() == []
    live.write_bytes(data[: len(data) // 2])  # killed inside the next save
    (torn,) = versions.left_torn()
    assert torn.live == live and "pickle" in torn.why
    assert "saved it again while rlsup copied it" in torn.no_version
    assert versions.restore() == [] and live.read_bytes() == data[: len(data) // 2]  # left as it is
