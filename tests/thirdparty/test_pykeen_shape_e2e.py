"""Issue 41, end to end: ``rlsup run`` with the README's single-file recipe around a trainer of PyKEEN's shape
(tests/jobs/pykeen_shape_job.py: one file rewritten in place after each epoch, resumed by the trainer itself,
progress printed only at the save), SIGKILLed by real signals.

Killed right after every attempt's first save, six times in a row, the run finishes: each attempt saved a new
epoch past the highest an earlier one reached. A real crash loop (killed in the same epoch every attempt, before
it saves) still ends in 76, and its last incident says rlsup gave up: no resume, no steps lost. A first save
cut in half leaves a torn file no version can replace: the incidents name it and why. (In process, the same
rule over the fake process layer: tests/run/test_progress_rule.py; PyKEEN itself: tests/thirdparty/test_thirdparty_pykeen_e2e.py.)
"""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path

from support.env import JOBS, PY
from support.incidents import incidents, read_state
from support.procs import rlsup_cmd, run_rlsup

EPOCHS = 10
RECIPE = ["--checkpoint-dir", "ckpts", "--checkpoint-layout", "single-file", "--checkpoint-file", "ckpt.pt",
          "--progress-regex", r"Saved checkpoint after having finished epoch (\d+)"]  # README: single file
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--max-restarts", "12",
        "--poll-interval", "0.1"]


def _run(cwd: Path, **faults: str) -> subprocess.CompletedProcess:
    return run_rlsup(["run", *RECIPE, *FAST, "--", PY, str(JOBS / "pykeen_shape_job.py"), "ckpts/ckpt.pt",
                      "--epochs", str(EPOCHS)], cwd, timeout=240, **faults)


def _listing(cwd: Path) -> str:
    return subprocess.run(rlsup_cmd("incidents", "--json"), cwd=cwd, capture_output=True, text=True,
                          timeout=60).stdout


def test_six_kills_right_after_each_attempts_first_save_finish(tmp_path: Path) -> None:
    done = _run(tmp_path, PKS_KILL_AFTER_FIRST_SAVE="6")
    assert done.returncode == 0, done.stderr[-4000:]
    recs = incidents(tmp_path / ".rlsup")
    assert [(r["reason"], r["signal"], r["action"]) for r in recs] == [("signal", "SIGKILL", "restart")] * 6, recs
    assert [r["last_step"] for r in recs] == list(range(1, 7))  # each attempt's one line: its first save
    assert all(r["resumed_from"] == str(tmp_path / "ckpts" / "ckpt.pt") for r in recs)
    assert pickle.loads((tmp_path / "ckpts" / "ckpt.pt").read_bytes())["epoch"] == EPOCHS
    state = read_state(tmp_path / ".rlsup")
    assert (state["state"], state["exit_code"], state["last_step"]) == ("succeeded", 0, EPOCHS)


def test_a_crash_loop_in_the_same_epoch_still_ends_in_76_with_a_true_last_incident(tmp_path: Path) -> None:
    done = _run(tmp_path, PKS_DIE_IN_EPOCH="3")
    assert done.returncode == 76, done.stderr[-4000:]
    recs = incidents(tmp_path / ".rlsup")
    assert [r["action"] for r in recs] == ["restart"] * 5 + ["no_progress"], recs
    assert recs[0]["last_step"] == 2  # attempt 0 saved epochs 1 and 2; the others saved nothing
    last = recs[-1]
    assert (last["reason"], last["signal"], last["last_step"]) == ("signal", "SIGKILL", None), last
    assert (last["downtime_s"], last["resumed_from"], last["resumed_step"], last["resume_known"]) == (None,) * 4, last
    assert last["left_torn"] == []  # ckpt.pt is whole (epoch 2): nothing to name
    state = read_state(tmp_path / ".rlsup")
    assert (state["state"], state["exit_code"]) == ("gave_up", 76), state
    assert pickle.loads((tmp_path / "ckpts" / "ckpt.pt").read_bytes())["epoch"] == 2  # never overwritten


def test_a_torn_first_save_with_no_version_is_named_when_rlsup_gives_up(tmp_path: Path) -> None:
    done = _run(tmp_path, PKS_TEAR_FIRST_SAVE="1")
    assert done.returncode == 76, done.stderr[-4000:]
    recs = incidents(tmp_path / ".rlsup")
    assert recs[-1]["action"] == "no_progress" and recs[-1]["resume_known"] is None, recs[-1]
    for rec in recs:
        (torn,) = rec["left_torn"]
        assert torn["file"] == str(tmp_path / "ckpts" / "ckpt.pt") and "pickle" in torn["torn"], rec
        assert "never saw it complete" in torn["no_version"], rec
    assert '"left_torn"' in _listing(tmp_path)  # `rlsup incidents --json` carries it
