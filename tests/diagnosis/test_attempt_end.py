"""supervisor.diagnosis.outcome: how an ending is classified, from the launcher's exit and its report (torchrun's
"Root Cause" block, NVRx ft_launcher's agent line), and from a rank seen dead by rlsup itself."""

from __future__ import annotations

from supervisor.diagnosis.outcome import classify_exit, from_rank_death, torchrun_root_cause
from supervisor.lifecycle import EndReason
from supervisor.diagnosis.rank_deaths import RankDeath

TORCHRUN_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_02:40:00
  host      : node7
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================""".splitlines()

FT_LINE = ["E1124 02:40:00 api.py:1 failed (exitcode: -9) local_rank: 1 (pid: 5151) of binary: /usr/bin/python"]


def test_torchrun_root_cause_and_ft_launcher_agent_line() -> None:
    assert torchrun_root_cause(TORCHRUN_REPORT) == (1, -9, 4242)
    assert torchrun_root_cause(FT_LINE) == (1, -9, 5151)
    assert torchrun_root_cause(["nothing to see"]) is None


def test_launcher_exit_1_with_a_sigkilled_worker_is_a_signal_of_that_rank() -> None:
    for tail, pid in ((TORCHRUN_REPORT, 4242), (FT_LINE, 5151)):
        r = classify_exit(3, 1, tail=tail, last_step=13, job_pid=99, first_dead=None, oom_rose=False,
                          stop_reason=None)
        assert (r.reason, r.exit_code, r.signal, r.rank, r.pid) == (EndReason.SIGNAL, 1, "SIGKILL", 1, pid)
        oom = classify_exit(3, 1, tail=tail, last_step=13, job_pid=99, first_dead=None, oom_rose=True,
                            stop_reason=None)
        assert oom.reason == EndReason.OOM


def test_plain_exits_success_and_stop() -> None:
    ok = classify_exit(0, 0, tail=[], last_step=5, job_pid=9, first_dead=None, oom_rose=False, stop_reason=None)
    assert ok.reason == EndReason.SUCCESS
    code = classify_exit(0, 3, tail=[], last_step=5, job_pid=9, first_dead=(2, 77), oom_rose=False,
                         stop_reason=None)
    assert (code.reason, code.exit_code, code.rank, code.pid) == (EndReason.EXIT_CODE, 3, 2, 77)
    stopped = classify_exit(0, 0, tail=[], last_step=5, job_pid=9, first_dead=None, oom_rose=False,
                            stop_reason=EndReason.PREEMPTED)
    assert stopped.reason == EndReason.PREEMPTED


def test_a_rank_seen_dead_by_rlsup() -> None:
    killed = from_rank_death(1, RankDeath(1, 4242, None, "SIGKILL"), tail=[], last_step=13, oom_rose=False)
    assert (killed.reason, killed.signal, killed.rank, killed.exit_code) == (EndReason.SIGNAL, "SIGKILL", 1, None)
    assert "without waiting for the launcher" in killed.detail
    assert from_rank_death(1, RankDeath(1, 4242, None, "SIGKILL"), tail=[], last_step=13, oom_rose=True).reason \
        == EndReason.OOM
    failed = from_rank_death(1, RankDeath(0, 11, 3, None), tail=[], last_step=2, oom_rose=False)
    assert (failed.reason, failed.exit_code, failed.rank) == (EndReason.EXIT_CODE, 3, 0)
