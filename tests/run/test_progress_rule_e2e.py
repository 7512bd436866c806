"""The end-to-end half of test_progress_rule.py (real processes, or waits on real time): issue 41's progress rule
and the record after giving up, in process: the real run loop, file versions, progress rule, restart policy and
incidents over the fake process layer, around a fake trainer of PyKEEN's shape (supervisor/run/progress_rule.py
says the rule)."""

from __future__ import annotations

import logging
import pickle
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor import exit_codes
from supervisor.config import SupervisorConfig
from supervisor.cli.incidents import incident_line, steps_lost
from supervisor.lifecycle import HUNG, JobStatus
from supervisor.run.loop import Supervisor

from support.fake_run_loop import Attempt, FakeJob, FakeProcesses, Recorder
from support.incidents import incidents, read_state

EPOCHS = 8  # the run's last epoch: the attempt that saves it exits 0


@dataclass
class Shape(Attempt):
    """One attempt of the PyKEEN-shaped trainer: ``epochs`` saves (one a tick, each reported as it is saved),
    then ``end``: ``kill`` (SIGKILL), ``hang`` (silent, never exits) or ``tear`` (the last save is cut in
    half by a SIGKILL). ``fresh``: ignores its checkpoint and starts over (a trainer that never resumes)."""

    epochs: int = 1
    end: str = "kill"
    fresh: bool = False
    ranks: int = 1


class PykeenJob(FakeJob):
    """The trainer: loads ``ckpt.pt`` as it starts (a torn one makes it exit 1, as PyKEEN's ``torch.load``
    does), rewrites it in place after each epoch and beats its step only then."""

    epoch = 0

    def poll(self) -> int | None:
        if self.code is not None:
            return self.code
        s: Shape = self.script  # type: ignore[assignment]
        ckpt: Path = self.layer.ckpt  # type: ignore[attr-defined]
        self.tick += 1
        if self.tick == 1 and ckpt.exists() and not s.fresh:
            try:
                self.epoch = pickle.loads(ckpt.read_bytes())["epoch"]
            except Exception:  # any error a torn pickle raises
                self.code = 1
                return self.code
        if self.tick <= s.epochs:
            self.epoch += 1
            data = pickle.dumps({"epoch": self.epoch, "weights": list(range(1000))})
            if s.end == "tear" and self.tick == s.epochs:
                ckpt.write_bytes(data[: len(data) // 2])  # killed inside its save
                self.code = -signal.SIGKILL
                return self.code
            with open(ckpt, "r+b" if ckpt.exists() else "wb") as f:  # in place, as torch.save over the file
                f.truncate(0)
                f.write(data)
            self._beat(0, self.epoch)  # "=> Saved checkpoint after having finished epoch N."
            if self.epoch == EPOCHS:
                self.code = 0
            return self.code
        if s.end != "hang":
            self.code = -signal.SIGKILL
        return self.code


class PykeenProcesses(FakeProcesses):
    def __init__(self, ckpt: Path, *attempts: Attempt) -> None:
        super().__init__(*attempts)
        self.ckpt = ckpt

    def start(self, command, env, log_path, tail_lines) -> FakeJob:  # type: ignore[override]
        assert self.script, "the loop launched more attempts than the test scripted"
        job = PykeenJob(self, self.script.pop(0), dict(env), 100_000 + 100 * len(self.jobs))
        self.jobs.append(job)
        return job


def run(tmp_path: Path, *attempts: Shape, **cfg: object) -> tuple[int, PykeenProcesses, Path]:
    """The README's single-file recipe around the fake trainer; rlsup's exit code, the layer, the state dir."""
    ckpt_dir = tmp_path / "ckpts"
    ckpt_dir.mkdir()
    settings = dict(checkpoint_dir=str(ckpt_dir), checkpoint_layout="single-file", checkpoint_file="ckpt.pt",
                    state_dir=str(tmp_path / "state"), metrics_port=0, poll_interval=0.005, backoff_initial=0.01,
                    backoff_max=0.02, backoff_jitter=0.0, heartbeat_timeout=0.3, startup_timeout=0.3,
                    warm_launcher=False, kill_grace=3.0, stop_grace=5.0, max_restarts=12)
    settings.update(cfg)
    layer = PykeenProcesses(ckpt_dir / "ckpt.pt", *attempts)
    sup = Supervisor(SupervisorConfig(**settings), ["pykeen", "experiments", "run"], observer=Recorder(),
                     processes=layer)
    return sup.run().exit_code, layer, tmp_path / "state"


def test_six_kills_right_after_each_attempts_first_save_finish(tmp_path: Path) -> None:
    """Issue 41: each attempt reports one step, at its save; the default max_no_progress_attempts (5) is
    never reached, each restart is at once (no backoff: every attempt progressed), and the run ends 0."""
    code, layer, state = run(tmp_path, *[Shape(epochs=1)] * 6, Shape(epochs=EPOCHS), backoff_initial=5.0)
    assert code == exit_codes.OK and len(layer.jobs) == 7
    recs = incidents(state)
    assert [(r["reason"], r["action"], r["last_step"]) for r in recs] == [("signal", "restart", e) for e in range(1, 7)]
    assert all(r["downtime_s"] < 5.0 for r in recs)  # backoff_initial 5 s never used: each failure followed progress
    assert pickle.loads(layer.ckpt.read_bytes())["epoch"] == EPOCHS


def test_a_hang_after_a_save_is_a_hang_and_progress(tmp_path: Path) -> None:
    """A hang ends the attempt as a hang; the epoch it saved first is progress all the same."""
    code, layer, state = run(tmp_path, *[Shape(epochs=1, end="hang")] * 6, Shape(epochs=EPOCHS))
    assert code == exit_codes.OK and len(layer.jobs) == 7
    recs = incidents(state)
    assert all(r["reason"] in HUNG and r["action"] == "restart" for r in recs) and len(recs) == 6
    assert [r["last_step"] for r in recs] == list(range(1, 7))


def test_a_crash_loop_at_the_same_step_ends_in_76_with_a_true_last_incident(tmp_path: Path) -> None:
    """Attempt 0 saves epochs 1 and 2 and dies in 3; every later attempt resumes from 2 and dies in 3 before
    saving: no new version, no step: 76 after 5 of them. The last incident says it gave up, claims no
    resume and no steps lost, and names no step the attempt did not report."""
    code, layer, state = run(tmp_path, Shape(epochs=2), *[Shape(epochs=0)] * 6)
    assert code == exit_codes.NO_PROGRESS and len(layer.jobs) == 6
    recs = incidents(state)
    assert [r["action"] for r in recs] == ["restart"] * 5 + ["no_progress"]
    assert recs[0]["last_step"] == 2
    last = recs[-1]
    assert (last["reason"], last["last_step"], last["left_torn"]) == ("signal", None, [])
    assert (last["downtime_s"], last["resumed_from"], last["resumed_step"], last["resume_known"]) == (None,) * 4
    assert steps_lost(last) is None and "gave up" in incident_line(last) and "resumed" not in incident_line(last)
    final = read_state(state)
    assert (final["state"], final["exit_code"]) == (JobStatus.GAVE_UP.value, exit_codes.NO_PROGRESS)


def test_a_trainer_that_starts_over_rewrites_its_file_without_progress(tmp_path: Path) -> None:
    """A new file version at the step an earlier attempt already reached is no progress: a trainer that
    ignores its checkpoint saves epoch 1 and dies every time. The last incident gives the step it reached."""
    code, layer, state = run(tmp_path, *[Shape(epochs=1, fresh=True)] * 7)
    assert code == exit_codes.NO_PROGRESS and len(layer.jobs) == 6  # attempt 0 progressed, then 5 did not
    last = incidents(state)[-1]
    assert (last["action"], last["last_step"], last["downtime_s"], last["resume_known"]) == ("no_progress", 1, None,
                                                                                            None)
    assert steps_lost(last) is None and "gave up at step 1" in incident_line(last)


def test_a_torn_file_with_no_version_to_put_back_is_named_with_why(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Attempt 0 is killed inside its first save: the only checkpoint is torn and no complete version of it
    was ever kept. Every restart dies loading it; rlsup gives up (76) and the incidents name the file, what is
    wrong with it, and why it could not be put back; the log says it once."""
    with caplog.at_level(logging.INFO, logger="supervisor"):
        code, layer, state = run(tmp_path, Shape(epochs=1, end="tear"), *[Shape(epochs=1)] * 6)
    said = [r.getMessage() for r in caplog.records if "cannot be put back" in r.getMessage()]
    assert len(said) == 1 and str(layer.ckpt) in said[0], said
    assert code == exit_codes.NO_PROGRESS and len(layer.jobs) == 5
    recs = incidents(state)
    assert recs[-1]["action"] == "no_progress" and all(r["resumed_from"] is None for r in recs)
    for rec in recs:  # the attempt that tore it, the restarts that met it, and the give-up
        (torn,) = rec["left_torn"]
        assert torn["file"] == str(layer.ckpt) and "pickle" in torn["torn"], rec
        assert "never saw it complete" in torn["no_version"], rec
    assert str(layer.ckpt) in incident_line(recs[-1])
    assert layer.ckpt.read_bytes() == pickle.dumps({"epoch": 1, "weights": list(range(1000))})[
        : len(pickle.dumps({"epoch": 1, "weights": list(range(1000))})) // 2]  # left as it was: never rewritten


