"""The end-to-end half of test_run_loop.py (real processes, or waits on real time): the run loop in-process, over a
fake process layer (torch elastic's TestAgent style): crash, hang, startup timeout, OOM, success, give-up, fatal,
no progress, stop, preemption, a lost supervisor."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from supervisor import exit_codes
from supervisor.lifecycle import JobStatus


from support.fake_run_loop import ATTEMPT, Attempt, incidents, make


def test_signal_and_oom(tmp_path: Path) -> None:
    sup, _, rec = make(tmp_path, Attempt(exit_code=-signal.SIGSEGV), Attempt(exit_code=-signal.SIGKILL, oom=True),
                       Attempt(exit_code=0))
    assert sup.run().exit_code == 0
    assert [(i["reason"], i["signal"]) for i in incidents(tmp_path)] == [("signal", "SIGSEGV"), ("oom", "SIGKILL")]
    assert rec.failures == ["signal", "oom"]


def test_hang_dumps_stacks_and_kills_without_grace(tmp_path: Path) -> None:
    sup, layer, _ = make(tmp_path, Attempt(exit_code=None, hang_at=3), Attempt(exit_code=0))
    t0 = time.monotonic()
    assert sup.run().exit_code == 0
    assert time.monotonic() - t0 < 5
    (inc,) = incidents(tmp_path)
    assert inc["reason"] == "hang" and inc["last_step"] == 2 and inc["rank"] == 0
    assert inc["stacks"] == {f"rank 0 pid {layer.jobs[0].rank_pid(0)}": "fake stack",
                             f"rank 1 pid {layer.jobs[0].rank_pid(1)}": "fake stack"}
    assert layer.jobs[0].grace == 0.0  # a hung job gets no kill_grace


def test_startup_timeout(tmp_path: Path) -> None:
    sup, layer, _ = make(tmp_path, Attempt(exit_code=None, beats=False), Attempt(exit_code=0))
    assert sup.run().exit_code == 0
    (inc,) = incidents(tmp_path)
    assert inc["reason"] == "startup_timeout" and layer.jobs[0].grace == 0.0


def test_retries_exhausted_gives_up_with_the_jobs_code(tmp_path: Path) -> None:
    sup, _, rec = make(tmp_path, *[Attempt(exit_code=4, saves=s) for s in (1, 2, 3)], max_restarts=2)
    result = sup.run()
    assert (result.exit_code, result.status, result.attempts) == (4, JobStatus.GAVE_UP, 3)
    assert [i["action"] for i in incidents(tmp_path)] == ["restart", "restart", "give_up"]
    assert rec.states[-2:] == ["failed", "gave_up"]


def test_no_progress_exits_76(tmp_path: Path) -> None:
    sup, layer, _ = make(tmp_path, *[Attempt(exit_code=1)] * 3, max_no_progress_attempts=3, max_restarts=10)
    result = sup.run()
    assert result.exit_code == exit_codes.NO_PROGRESS and len(layer.jobs) == 3
    assert [i["action"] for i in incidents(tmp_path)] == ["restart", "restart", "no_progress"]


def test_no_progress_after_a_save_counts_only_the_attempts_that_saved_nothing_newer(tmp_path: Path) -> None:
    """Attempt 0 saves step 5 (progress); attempts 1 and 2 resume from it and save step 5 again (nothing
    newer): given up after attempt 2, with the do-not-requeue code (was test_supervisor_run's real run)."""
    sup, layer, _ = make(tmp_path, *[Attempt(exit_code=1, saves=5) for _ in range(3)], max_no_progress_attempts=2,
                         max_restarts=10)
    result = sup.run()
    assert (result.exit_code, result.status) == (exit_codes.NO_PROGRESS, JobStatus.GAVE_UP) and len(layer.jobs) == 3
    inc = incidents(tmp_path)
    assert [i["action"] for i in inc] == ["restart", "restart", "no_progress"]
    assert inc[1]["resumed_step"] == 5 and layer.jobs[1].env["RLSUP_RESUME_STEP"] == "5"


@pytest.mark.parametrize("preempted", [False, True])
def test_stop_during_backoff(tmp_path: Path, preempted: bool) -> None:
    sup, layer, rec = make(tmp_path, Attempt(exit_code=1), Attempt(exit_code=0), backoff_initial=30.0)
    rec.on_state["backoff"] = lambda: sup.request_stop(signal.SIGTERM, preempted=preempted)
    t0 = time.monotonic()
    result = sup.run()
    assert time.monotonic() - t0 < 5  # the 30 s backoff was cut short
    final = "preempted" if preempted else "stopped"
    assert rec.states == [*ATTEMPT, "failed", "backoff", final] and len(layer.jobs) == 1
    assert result.exit_code == (exit_codes.REQUEUE if preempted else 128 + signal.SIGTERM)
    assert [i["action"] for i in incidents(tmp_path)] == ["restart"]  # the failure, recorded once


