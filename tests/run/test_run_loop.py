"""The run loop in-process, over a fake process layer (torch elastic's TestAgent style): crash, hang,
startup timeout, OOM, success, give-up, fatal, no progress, stop, preemption, a lost supervisor.

No process is started: :class:`FakeProcesses` hands the loop scripted jobs whose ranks heartbeat into
the real heartbeat directory, so the real :class:`HangDetector`, classification, restart policy,
incidents and state table run as in production. Each test takes well under a second.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from supervisor import exit_codes
from supervisor.run.incidents import read_state
from supervisor.lifecycle import IllegalTransition, JobStatus
from supervisor.diagnosis.evidence import EndedElsewhere
from supervisor.diagnosis.step_reports import JOB_RANK
from supervisor.lifecycle import EndReason
from supervisor.run.peers import SingleNode


from support.fake_run_loop import ATTEMPT, Attempt, incidents, make


def test_success(tmp_path: Path) -> None:
    sup, layer, rec = make(tmp_path, Attempt(exit_code=0))
    result = sup.run()
    assert (result.exit_code, result.status, result.attempts) == (0, JobStatus.SUCCEEDED, 1)
    assert rec.states == [*ATTEMPT, "succeeded"] and incidents(tmp_path) == []
    state = read_state(tmp_path / "state")
    assert state is not None and state["state"] == "succeeded" and state["exit_code"] == 0
    assert layer.jobs[0].grace == 3.0  # every attempt's tree is cleaned up (orphans), with kill_grace


def test_crash_then_resume_and_success(tmp_path: Path) -> None:
    sup, layer, rec = make(tmp_path, Attempt(exit_code=3, exit_at=4, saves=2), Attempt(exit_code=0))
    result = sup.run()
    assert result.exit_code == 0 and result.attempts == 2
    assert rec.states == [*ATTEMPT, "failed", "backoff", *ATTEMPT, "succeeded"]
    (inc,) = incidents(tmp_path)
    # the job beat step 4 and exited in the same tick: the exit path reads that last beat too
    assert (inc["reason"], inc["exit_code"], inc["action"], inc["last_step"]) == ("exit_code", 3, "restart", 4)
    assert inc["resumed_step"] == 2 and inc["downtime_s"] is not None and inc["output_tail"] == ["attempt 0 output"]
    second = layer.jobs[1].env
    assert second["RLSUP_RESTART_COUNT"] == "1" and second["RLSUP_RESUME_STEP"] == "2"
    assert layer.jobs[0].grace == 0.0  # a crashed attempt is killed at once (SIGKILL, no kill_grace)


def test_dead_rank_is_named(tmp_path: Path) -> None:
    sup, _, _ = make(tmp_path, Attempt(exit_code=1, dead_rank=1), Attempt(exit_code=0))
    assert sup.run().exit_code == 0
    (inc,) = incidents(tmp_path)
    assert inc["rank"] == 1 and "rank 1" in inc["detail"]


def test_fatal_exit_code(tmp_path: Path) -> None:
    sup, layer, _ = make(tmp_path, Attempt(exit_code=42), fatal_exit_codes=[42])
    assert sup.run().exit_code == 42 and len(layer.jobs) == 1
    assert incidents(tmp_path)[0]["action"] == "fatal"


def test_stop_while_running(tmp_path: Path) -> None:
    sup, layer, rec = make(tmp_path, Attempt(exit_code=None))
    layer.script[0].on_tick = (2, lambda: sup.request_stop(signal.SIGTERM))
    result = sup.run()
    assert (result.exit_code, result.status) == (128 + signal.SIGTERM, JobStatus.STOPPED)
    assert rec.states == [*ATTEMPT, "stopping", "stopped"]
    assert layer.jobs[0].signals == [signal.SIGTERM]  # the whole tree is signalled
    (inc,) = incidents(tmp_path)
    assert (inc["reason"], inc["action"], inc["exit_code"]) == ("stopped", "stop", 0)


def test_preemption_relays_to_ranks_and_exits_for_requeue(tmp_path: Path) -> None:
    sup, layer, rec = make(tmp_path, Attempt(exit_code=None))
    layer.script[0].on_tick = (2, lambda: sup.request_stop(signal.SIGUSR1, preempted=True))
    result = sup.run()
    assert (result.exit_code, result.status) == (exit_codes.REQUEUE, JobStatus.PREEMPTED)
    assert rec.states == [*ATTEMPT, "stopping", "preempted"]
    job = layer.jobs[0]
    assert job.signals == [] and sorted(layer.rank_signals) == [(job.rank_pid(0), signal.SIGUSR1),
                                                                 (job.rank_pid(1), signal.SIGUSR1)]
    assert job.stop_requested()  # the stop flag in every rank's heartbeat file
    assert incidents(tmp_path)[0]["reason"] == "preempted"


@pytest.mark.parametrize("ranks_beat", [True, False])
def test_preemption_beside_the_outputs_progress_record_reaches_only_the_ranks(tmp_path: Path, ranks_beat: bool) -> None:
    """With ``progress`` and trainer_hooks both, the job's root (the output's record: torchrun) is not
    signalled: it would end its ranks while they save; nor while the ranks have registered but not yet
    beaten (restoring: their handlers are installed)."""
    sup, layer, _ = make(tmp_path, Attempt(exit_code=None, beats=ranks_beat))

    def progress_line_then_preempt() -> None:
        if not ranks_beat:
            for rank in range(2):
                layer.jobs[0]._beat(rank, 0, registered_only=True)
        layer.jobs[0]._beat(JOB_RANK, 2)  # the output's record: the job root's pid
        sup.request_stop(signal.SIGUSR1, preempted=True)

    layer.script[0].on_tick = (2, progress_line_then_preempt)
    assert sup.run().exit_code == exit_codes.REQUEUE
    job = layer.jobs[0]
    assert sorted(layer.rank_signals) == [(job.rank_pid(0), signal.SIGUSR1), (job.rank_pid(1), signal.SIGUSR1)]


def test_stop_ignored_is_killed_after_stop_grace(tmp_path: Path) -> None:
    sup, layer, _ = make(tmp_path, Attempt(exit_code=None, stop_exit=None))
    layer.script[0].on_tick = (2, lambda: sup.request_stop(signal.SIGINT))
    assert sup.run().exit_code == 128 + signal.SIGINT
    incident = incidents(tmp_path)[0]
    assert incident["detail"] == "killed after stop_grace" and layer.jobs[0].grace == 3.0
    assert set(incident["stacks"].values()) == {"fake stack"} and incident["stacks"]  # where the ranks were stuck


def test_job_exits_on_its_own_after_the_stop_signal(tmp_path: Path) -> None:
    """SIGINT from a terminal reaches the job too: it may exit before rlsup acts; still STOPPING -> STOPPED."""
    sup, layer, rec = make(tmp_path, Attempt(exit_code=130, exit_at=2))
    layer.script[0].on_tick = (2, lambda: sup.request_stop(signal.SIGINT))
    assert sup.run().exit_code == 128 + signal.SIGINT
    assert rec.states == [*ATTEMPT, "stopping", "stopped"]


def test_real_sigterm_reaches_the_loop_and_handlers_are_restored(tmp_path: Path) -> None:
    def sentinel(*_: object) -> None:
        pytest.fail("the supervisor's SIGTERM handler was not installed")

    original = signal.signal(signal.SIGTERM, sentinel)
    try:
        sup, layer, _ = make(tmp_path, Attempt(exit_code=None))
        layer.script[0].on_tick = (2, lambda: os.kill(os.getpid(), signal.SIGTERM))
        assert sup.run().exit_code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is sentinel  # the handler run() replaced is back
    finally:
        signal.signal(signal.SIGTERM, original)


def test_supervisor_lost_is_recorded_and_the_next_attempt_runs(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "state.json").write_text(json.dumps({"state": "running", "attempt": 4, "pid": 999_999_999,
                                                      "last_step": 17}))
    sup, layer, _ = make(tmp_path, Attempt(exit_code=0))
    assert sup.run().exit_code == 0
    (inc,) = incidents(tmp_path)
    assert (inc["reason"], inc["action"], inc["attempt"], inc["last_step"]) == ("supervisor_lost", "restart", 4, 17)
    assert layer.jobs[0].env["RLSUP_RESTART_COUNT"] == "5"


def test_a_final_state_does_not_count_as_lost(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "state.json").write_text(json.dumps({"state": "succeeded", "attempt": 4, "pid": 999_999_999}))
    sup, layer, _ = make(tmp_path, Attempt(exit_code=0))
    assert sup.run().exit_code == 0 and incidents(tmp_path) == []
    assert layer.jobs[0].env["RLSUP_RESTART_COUNT"] == "0"


def test_illegal_transition_raises(tmp_path: Path) -> None:
    sup, _, _ = make(tmp_path)
    with pytest.raises(IllegalTransition, match="INIT -> RUNNING"):
        sup.record.set_state(JobStatus.RUNNING)


def test_the_loop_gets_its_settings_built_once(tmp_path: Path) -> None:
    """The loop's own settings object: typed values (the preemption signal, straggler_action as a flag),
    absolute paths; the job's RLSUP_PREEMPT_SIGNAL is the signal's name."""
    sup, layer, _ = make(tmp_path, Attempt(exit_code=0), preempt_signal="USR2", straggler_action="restart")
    s = sup.settings
    assert (s.preempt_signal, s.straggler_restart, s.state_dir) == (signal.SIGUSR2, True, tmp_path / "state")
    assert sup.run().exit_code == 0
    assert layer.jobs[0].env["RLSUP_PREEMPT_SIGNAL"] == "SIGUSR2"
    assert read_state(tmp_path / "state")["resume_tier"] is None  # a fresh start names no tier


def test_the_resume_point_names_its_tier_in_state_and_incident(tmp_path: Path) -> None:
    sup, _, _ = make(tmp_path, Attempt(exit_code=1, saves=2), Attempt(exit_code=0))
    assert sup.run().exit_code == 0
    (inc,) = incidents(tmp_path)
    assert (inc["resumed_step"], inc["resumed_tier"]) == (2, "local")
    assert read_state(tmp_path / "state")["resume_tier"] == "local"


class _GrowingBack(SingleNode):
    """Node 0 of a smaller world ends attempts 0 and 1 to grow the job back (``resized``), as
    :class:`supervisor.cluster.multinode.NodeGroup` reports it; the job's other side is not needed here."""

    def peer_ended(self, attempt: int, grow: bool = True) -> EndedElsewhere | None:
        return EndedElsewhere(EndReason.RESIZED, f"node 0: ending attempt {attempt} to grow back") if attempt < 2 else None


def test_an_attempt_ended_to_grow_the_job_back_is_no_failure(tmp_path: Path) -> None:
    """With max_restarts 0 a failure would end the run; two grow-back ends do not: each next attempt starts at
    once, the incidents say ``resized`` and ``restart``, and no failure reaches the metrics."""
    sup, layer, rec = make(tmp_path, Attempt(exit_code=None), Attempt(exit_code=None), Attempt(exit_code=0),
                           peers=_GrowingBack(), max_restarts=0, backoff_initial=60.0, backoff_max=60.0)
    result = sup.run()
    assert (result.exit_code, result.status, result.attempts) == (0, JobStatus.SUCCEEDED, 3)
    assert [(i["reason"], i["action"]) for i in incidents(tmp_path)] == [("resized", "restart")] * 2
    assert rec.failures == [] and rec.states.count("resizing") == 2 and "backoff" not in rec.states
    assert all(j.code is not None or j.signals for j in layer.jobs[:2])  # each ended attempt's job was stopped


def test_a_job_that_died_of_node_0_s_end_to_grow_back_is_no_failure(tmp_path: Path) -> None:
    """Node 0 ended the attempt to grow back and killed its ranks: this node's ranks die in their collective before
    its watch looked at the store. The exit is taken for what it is, the grow (``resized``), not a failure."""
    layer: list = []

    class DiedOfTheGrow(SingleNode):
        def peer_ended(self, attempt: int, grow: bool = True) -> EndedElsewhere | None:
            exited = attempt == 0 and layer and layer[0].jobs and layer[0].jobs[0].code is not None
            return EndedElsewhere(EndReason.RESIZED, "node 0: ending attempt 0 to grow back") if exited else None

    sup, processes, rec = make(tmp_path, Attempt(exit_code=1, exit_at=2), Attempt(exit_code=0),
                               peers=DiedOfTheGrow(), max_restarts=0)
    layer.append(processes)
    result = sup.run()
    assert (result.exit_code, result.status, result.attempts) == (0, JobStatus.SUCCEEDED, 2)
    assert [(i["reason"], i["action"]) for i in incidents(tmp_path)] == [("resized", "restart")]
    assert rec.failures == []


def test_a_success_that_node_0_s_grow_back_came_before_goes_on_with_every_node(tmp_path: Path) -> None:
    """This node's ranks finished at the job's last save, but node 0 had already ended the attempt there to grow the
    job back (:meth:`Peers.attempt_succeeded` says ``resized``): the run goes on with the others (the next attempt
    resumes from that save and finishes at once), recorded as the grow, never as a success nor a failure."""

    class GrowCameFirst(SingleNode):
        def attempt_succeeded(self, attempt: int) -> EndedElsewhere | None:
            return EndedElsewhere(EndReason.RESIZED, "node 0: ending attempt 0 to grow back") if attempt == 0 else None

    sup, layer, rec = make(tmp_path, Attempt(exit_code=0), Attempt(exit_code=0), peers=GrowCameFirst(), max_restarts=0)
    result = sup.run()
    assert (result.exit_code, result.status, result.attempts) == (0, JobStatus.SUCCEEDED, 2)
    assert [(i["reason"], i["action"]) for i in incidents(tmp_path)] == [("resized", "restart")]
    assert rec.failures == [] and rec.states.count("resizing") == 1


def test_a_success_never_reports_a_step_below_the_one_it_resumed_from(tmp_path: Path) -> None:
    """A restart that resumes at the job's final step trains none and its trainer's first bar draw says ``0/N``
    (HF's, before it jumps): ``rlsup status`` must still say the step the job reached, not 0."""
    sup, _, _ = make(tmp_path, Attempt(exit_code=1, exit_at=4, saves=20), Attempt(exit_code=0, exit_at=1))
    assert sup.run().exit_code == 0
    (inc,) = incidents(tmp_path)
    assert inc["resumed_step"] == 20
    assert read_state(tmp_path / "state")["last_step"] == 20
