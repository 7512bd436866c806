"""In process: every way an attempt ends, built as evidence and classified once
(:func:`supervisor.diagnosis.outcome.classify`), compared as the incident line it becomes.

The GPU's word comes from a kernel log this test writes and a probe it stands in for NVML: never the host's.
"""

from __future__ import annotations

import time
from dataclasses import FrozenInstanceError, asdict
from pathlib import Path
from typing import Any

import pytest
from support.fake_run_loop import Attempt, incidents, make

from supervisor import exit_codes
from supervisor.diagnosis.evidence import (AttemptEvidence, EndedElsewhere, ExitSeen, FlightEvidence, GpuEvidence,
                                           HangSeen, HealthFailed, StopSeen)
from supervisor.diagnosis.gpu_failures import GpuProbe
from supervisor.diagnosis.outcome import classify, job_settled
from supervisor.diagnosis.rank_deaths import RankDeath
from supervisor.diagnosis.step_reports import JOB_RANK
from supervisor.diagnosis.stragglers import StragglerReport
from supervisor.diagnosis.unkillable import Mount, StuckProcess, verdict
from supervisor.lifecycle import Action, EndReason
from supervisor.run.incidents import Incident
from supervisor.run.record import incident_for

R = EndReason
NODE = "n1"
TAIL = ("step 7", "ValueError: bad batch")
XID = "NVRM: Xid (PCI:0000:44:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
OURS = GpuProbe(frozenset({(0, 0x44, 0)}), None, "NVML: 8 GPU(s) healthy")  # the Xid's GPU is the job's
SILENT = "rank 3 (pid 103) silent for 31.00s > heartbeat_timeout 30.00s"
ALL_REDUCE = """Current thread 0x00007fa4195d8b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2050 in all_reduce
  File "/work/train.py", line 120 in train_step
"""
LOADING = """Current thread 0x00007fa4195d8b80 (most recent call first):
  File "/work/data.py", line 55 in load_batch
  File "/work/train.py", line 118 in train_step
"""
STACKS = {**{f"rank {r} pid {100 + r}": ALL_REDUCE for r in range(3)}, "rank 3 pid 103": LOADING}
STACK_VERDICT = ("ranks 0-2 wait in `all_reduce` (train.py:120); rank 3 is in `load_batch` (data.py:55): suspect "
                 "rank 3 on node n1")
STUCK = StuckProcess(4242, "D", "python", "request_wait_answer", 1, "/ckpt/step_4/rank_1.pt", ["/ckpt/step_4"],
                     [Mount("/ckpt", "fuse.sickfs", "sickfs")])


def never_asked() -> GpuProbe:
    raise AssertionError("NVML was asked with no GPU fault to confirm")


@pytest.fixture
def quiet_log(tmp_path: Path) -> GpuEvidence:
    """A kernel log with no GPU fault in it: read, and NVML never asked."""
    path = tmp_path / "kmsg"
    path.write_text("6,2301,1000,-;mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE\n")
    return GpuEvidence(0.0, path, never_asked)


@pytest.fixture
def xid_log(tmp_path: Path) -> GpuEvidence:
    """A kernel log with Xid 79 on the job's GPU, logged 10 s after boot (the attempt started at boot)."""
    path = tmp_path / "kmsg_xid"
    path.write_text(f"4,2302,10000000,-;{XID}\n")
    return GpuEvidence(0.0, path, lambda: OURS)


def evidence(ending: Any, **seen: Any) -> AttemptEvidence:
    return AttemptEvidence(3, ending, NODE, **{"last_step": 7, "output_tail": TAIL, **seen})


def incident(ev: AttemptEvidence, action: Action = Action.RESTART) -> dict[str, Any]:
    """The incident line (as incidents.jsonl holds it, less its time) of the attempt ``ev`` describes."""
    line = asdict(incident_for(classify(ev), action))
    line.pop("time")
    return line


def expected(reason: EndReason, action: Action = Action.RESTART, **fields: Any) -> dict[str, Any]:
    line = asdict(Incident(time=0.0, attempt=3, reason=reason, action=action, last_step=7, output_tail=list(TAIL)))
    line.pop("time")
    return {**line, **fields}


def test_an_exit_code(quiet_log: GpuEvidence) -> None:
    assert incident(evidence(ExitSeen(1, 99), gpu=quiet_log)) == expected(R.EXIT_CODE, exit_code=1,
                                                                         detail="exit code 1")


def test_a_signal_death_and_the_oom_killer(quiet_log: GpuEvidence) -> None:
    killed = expected(R.SIGNAL, exit_code=-9, signal="SIGKILL", pid=99, detail="exit code -9, SIGKILL")
    assert incident(evidence(ExitSeen(-9, 99), gpu=quiet_log)) == killed
    assert incident(evidence(ExitSeen(-9, 99), gpu=quiet_log, oom_rose=True)) == {**killed, "reason": R.OOM}


def test_a_rank_death_seen_by_pidfd(quiet_log: GpuEvidence) -> None:
    after = "attempt ended without waiting for the launcher"
    assert incident(evidence(RankDeath(1, 4242, None, "SIGSEGV"), gpu=quiet_log)) == expected(
        R.SIGNAL, signal="SIGSEGV", rank=1, pid=4242, detail=f"rank 1 (pid 4242) died: signal SIGSEGV; {after}")
    assert incident(evidence(RankDeath(0, 11, 3, None), gpu=quiet_log)) == expected(
        R.EXIT_CODE, exit_code=3, rank=0, pid=11, detail=f"rank 0 (pid 11) died: exit code 3; {after}")


def test_a_hang_is_blamed_on_the_rank_its_stacks_single_out(quiet_log: GpuEvidence) -> None:
    assert incident(evidence(HangSeen(R.HANG, SILENT, 3, 103, STACKS), gpu=quiet_log)) == expected(
        R.HANG, rank=3, pid=103, detail=SILENT, stacks=STACKS, verdict=STACK_VERDICT, suspect_ranks=[3],
        suspect_nodes=[NODE])


def test_a_hang_in_the_output_names_the_stuck_trainer_never_the_launcher() -> None:
    hang = HangSeen(R.HANG, "the job's output silent for 31.00s > heartbeat_timeout 30.00s", JOB_RANK, 50,
                    {"rank 0 pid 100": ALL_REDUCE})
    got = classify(evidence(hang))
    assert (got.rank, got.pid) == (0, 100) and got.verdict.startswith("stuck: ") and "on node n1" in got.verdict
    assert got.detail.startswith(hang.detail + "; stuck: ")
    nobody = classify(evidence(HangSeen(R.HANG, hang.detail, JOB_RANK, 50, STACKS | {"rank 4 pid 104": LOADING})))
    assert (nobody.rank, nobody.pid) == (None, None)  # two equally likely: nobody rather than the launcher


def test_a_process_stuck_in_d_makes_any_failure_unkillable_and_names_the_node(quiet_log: GpuEvidence) -> None:
    line = verdict([STUCK], 2.0)
    detail = f"{line} (the attempt had ended: exit_code: exit code 1)"
    assert incident(evidence(ExitSeen(1, 99), gpu=quiet_log, stuck=(STUCK,), kill_grace=2.0),
                    Action.EXCLUDE_NODE) == expected(
        R.UNKILLABLE, Action.EXCLUDE_NODE, exit_code=1, rank=1, pid=4242, detail=detail, suspect_ranks=[1],
        verdict=f"node n1 is unhealthy: {detail}", suspect_nodes=[NODE])
    stopped = classify(evidence(StopSeen(R.STOPPED, 0), stuck=(STUCK,), kill_grace=2.0))
    assert (stopped.reason, stopped.detail) == (R.STOPPED, "job exited with 0")  # a stop stays a stop


def test_a_gpu_fault_in_the_kernel_log_beats_what_the_ranks_printed(xid_log: GpuEvidence,
                                                                   quiet_log: GpuEvidence) -> None:
    nccl = ("step 7", "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled "
            "system error")
    got = incident(evidence(ExitSeen(1, 99), gpu=xid_log, output_tail=nccl), Action.EXCLUDE_NODE)
    detail = got["detail"]
    assert detail.startswith("exit code 1; ") and f"Xid 79 (kernel log): {XID}" in detail, detail
    assert got == expected(R.GPU_LOST, Action.EXCLUDE_NODE, exit_code=1, detail=detail, output_tail=list(nccl),
                           verdict=f"node n1 is unhealthy: {detail}", suspect_nodes=[NODE])
    assert classify(evidence(ExitSeen(1, 99), gpu=quiet_log, output_tail=nccl)).reason == R.NCCL_ERROR
    later = GpuEvidence(20.0, xid_log.kernel_log, never_asked)  # an Xid before the attempt started is not its own
    assert classify(evidence(ExitSeen(1, 99), gpu=later, output_tail=nccl)).reason == R.NCCL_ERROR
    hung = classify(evidence(HangSeen(R.HANG, SILENT, 3, 103, STACKS), gpu=xid_log))
    assert hung.reason == R.GPU_LOST and hung.detail.startswith(SILENT + "; ") and hung.verdict == STACK_VERDICT
    assert hung.suspect_nodes == [NODE, NODE]  # the stacks' suspect node, and the excluded one (as before)


def test_the_flight_recorders_verdicts_lead_the_stacks(quiet_log: GpuEvidence) -> None:
    ours = FlightEvidence("flight recorder: rank 2 never joined ALLREDUCE (SeqNum=12)", (2,))
    hang = HangSeen(R.HANG, SILENT, 3, 103, STACKS)
    base = dict(rank=3, pid=103, detail=SILENT, stacks=STACKS, verdict=STACK_VERDICT)
    assert incident(evidence(hang, gpu=quiet_log, flight=ours)) == expected(
        R.HANG, **base, fr_verdict=ours.text, suspect_ranks=[2], suspect_nodes=[NODE])
    across = FlightEvidence("flight recorder: rank 9 never joined ALLREDUCE (SeqNum=12)", (9,), ("n2",))
    assert incident(evidence(hang, gpu=quiet_log, flight=ours, shared_flight=across)) == expected(
        R.HANG, **base, fr_verdict=across.text, suspect_ranks=[9], suspect_nodes=[NODE, "n2"])
    none_came = FlightEvidence(missing="rlsup asked to stop")
    assert classify(evidence(hang, flight=ours, shared_flight=none_came)).fr_verdict == \
        f"{ours.text} (no verdict across nodes: rlsup asked to stop)"


def test_a_straggler() -> None:
    report = StragglerReport(0.0, 3, 2, 202, NODE, 3.0, [3.0] * 5, "arrival", 40)
    said = report.describe()
    assert incident(evidence(report)) == expected(R.STRAGGLER, rank=2, pid=202, detail=said, verdict=said,
                                                  suspect_ranks=[2], suspect_nodes=[NODE])


def test_endings_without_a_failed_job() -> None:
    assert incident(evidence(EndedElsewhere(R.PEER_FAILURE, "node 1: hang ..."))) == expected(
        R.PEER_FAILURE, detail="node 1: hang ...")
    assert incident(evidence(StopSeen(R.PREEMPTED, None, STACKS)), Action.STOP) == expected(
        R.PREEMPTED, Action.STOP, detail="killed after stop_grace", stacks=STACKS, verdict=STACK_VERDICT,
        suspect_ranks=[3], suspect_nodes=[NODE])
    sick = incident(AttemptEvidence(3, HealthFailed("nvidia-smi failed", ("no devices",)), NODE), Action.EXCLUDE_NODE)
    assert sick == {**expected(R.UNHEALTHY, Action.EXCLUDE_NODE, detail="nvidia-smi failed", output_tail=["no devices"],
                               verdict="node n1 is unhealthy: nvidia-smi failed", suspect_nodes=[NODE]),
                    "last_step": None}
    assert job_settled(ExitSeen(0, 9)) and job_settled(StopSeen(R.STOPPED, None))
    assert not job_settled(ExitSeen(1, 9)) and job_settled(ExitSeen(1, 9, finished="done"))


def test_the_outcome_is_frozen_and_the_evidence_too() -> None:
    got = classify(evidence(ExitSeen(0, 9)))
    assert got.reason == R.SUCCESS
    with pytest.raises(FrozenInstanceError):
        got.reason = R.HANG  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        evidence(ExitSeen(0, 9)).stuck = (STUCK,)  # type: ignore[misc]


def test_the_run_loop_reads_the_kernel_log_it_is_given_for_an_exit(tmp_path: Path) -> None:
    """The loop's seam (``kernel_log``, ``gpu_probe``) reaches an exit, not only a hang: a crash with the job's GPU
    lost in the given kernel log ends the run with 77 (the host's kernel log is never read)."""
    kmsg = tmp_path / "kmsg"

    def kernel_logs() -> None:  # stamped now: inside this attempt
        kmsg.write_text(f"4,2302,{int(time.monotonic() * 1e6)},-;{XID}\n")

    sup, layer, recorder = make(tmp_path, Attempt(exit_code=1, exit_at=3, on_tick=(1, kernel_logs)), Attempt())
    sup.kernel_log, sup.gpu_probe = kmsg, lambda: OURS
    assert sup.run().exit_code == exit_codes.UNHEALTHY
    (inc,) = incidents(tmp_path)
    assert (inc["reason"], inc["action"], inc["exit_code"]) == ("gpu_lost", "exclude_node", 1), inc
