"""The smaller faults found running rlsup around real third-party trainers (issue 28): the stacks of a
stopped process, no suspect node on a one-node job, no stray ``./checkpoints``, and the signal and rank
of a worker killed under accelerate's launcher or reported in torchelastic's structured error file.
Real processes throughout (accelerate and torchrun as installed); waits are polls with deadlines."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support.incidents import incidents
from support.ports import free_ports
from support.procs import run_rlsup
from support.waits import wait_for
from supervisor.diagnosis.outcome import ERROR_FILE_NAME, accelerate_child_exit, classify_exit
from supervisor.run.node_health import mark_repeat_offender
from supervisor.run.incidents import Incident
from supervisor.lifecycle import Action, EndReason
from supervisor.diagnosis.stacks import STOPPED_NOTE, find_pyspy, job_tree_stacks, process_stopped

PY = sys.executable
ACCELERATE = [PY, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]

PARKED = textwrap.dedent("""\
    import time
    def parked_in_here():
        print("parked", flush=True)
        time.sleep(600)
    parked_in_here()
""")


def test_a_stopped_process_stacks_are_read() -> None:
    """py-spy's blocking dump fails on a SIGSTOPped process; rlsup reads it without pausing it, and says
    it was stopped. A running process is still paused for a consistent read (no note)."""
    pyspy = find_pyspy()
    if pyspy is None:
        pytest.skip("py-spy is not installed")
    proc = subprocess.Popen([PY, "-c", PARKED], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "parked"
        running = job_tree_stacks(pyspy, proc.pid)
        assert any("parked_in_here" in text and STOPPED_NOTE not in text for text in running.values()), running
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: process_stopped(proc.pid), 10, "the process to stop")
        stopped = job_tree_stacks(pyspy, proc.pid)
        (text,) = stopped.values()
        assert text.startswith(STOPPED_NOTE) and "parked_in_here" in text, stopped
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def _incident(attempt: int, reason: EndReason = EndReason.EXIT_CODE) -> Incident:
    return Incident(time=time.time(), attempt=attempt, reason=reason, action=Action.RESTART)


def test_a_one_node_job_names_no_suspect_node() -> None:
    """Every failure of a one-node job is that node's: failing twice says nothing of the node, and there is
    no other node of the job to run on. With several nodes, a node failing again is still named."""
    one = [_incident(0), _incident(1), _incident(2)]
    for i, inc in enumerate(one):
        assert not mark_repeat_offender(inc, one[:i], "vm")
        assert inc.suspect_nodes == [] and inc.verdict == ""
    several = [_incident(0), _incident(1)]
    assert not mark_repeat_offender(several[0], [], "n1", nodes=4)
    assert mark_repeat_offender(several[1], several[:1], "n1", nodes=4)
    assert several[1].suspect_nodes == ["n1"] and several[1].verdict == "node n1 failed 2 attempts of this run"
    peer = _incident(1, EndReason.PEER_FAILURE)  # another node's failure is not this one's
    assert not mark_repeat_offender(peer, several[:1], "n1", nodes=4)


def test_no_checkpoint_dir_is_made_for_a_job_that_saves_none(tmp_path: Path) -> None:
    r = run_rlsup(["run", "--", PY, "-c", "print(1)"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "checkpoints").exists(), sorted(p.name for p in tmp_path.iterdir())


KILL_RANK_1 = textwrap.dedent("""\
    import os, signal, time
    print("rank", os.environ.get("RANK", "-"), flush=True)
    if os.environ.get("RANK", "0") == "1" or os.environ.get("KILL_ALONE"):
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
""")


def _one_incident(workdir: Path, command: list[str], **env: str) -> dict:
    r = run_rlsup(["run", "--max-restarts", "0", "--kill-grace", "2", "--", *command], workdir, timeout=120, **env)
    assert r.returncode != 0, r.stderr
    (inc,) = incidents(workdir / ".rlsup")
    return inc


def test_accelerate_one_process_launcher_sigkilled_worker(tmp_path: Path) -> None:
    """``accelerate launch --cpu`` runs the script as its child and exits 1 with a CalledProcessError:
    the incident names the signal and rank 0 (the job's one process), not just "exit code 1"."""
    (tmp_path / "train.py").write_text(KILL_RANK_1)
    inc = _one_incident(tmp_path, [*ACCELERATE, "--cpu", "--num_processes", "1", "train.py"], KILL_ALONE="1")
    assert (inc["reason"], inc["exit_code"], inc["signal"], inc["rank"]) == ("signal", 1, "SIGKILL", 0), inc
    assert inc["detail"] == "exit code 1, SIGKILL (rank 0)", inc["detail"]


def test_accelerate_multi_process_launcher_sigkilled_rank(tmp_path: Path) -> None:
    """``accelerate launch --multi_gpu --num_processes 2`` on CPU runs torchrun's agent in process: rank 1
    SIGKILLed is named with its pid (accelerate writes no structured error file; the report is read)."""
    (tmp_path / "train.py").write_text(KILL_RANK_1)
    (port,) = free_ports(1)
    inc = _one_incident(tmp_path, [*ACCELERATE, "--multi_gpu", "--num_processes", "2", "--main_process_port",
                                   str(port), "train.py"])
    assert (inc["reason"], inc["exit_code"], inc["signal"], inc["rank"]) == ("signal", 1, "SIGKILL", 1), inc
    assert inc["pid"] and inc["detail"] == f"exit code 1, SIGKILL (rank 1, pid {inc['pid']})"


RECORDED_RAISE = textwrap.dedent("""\
    import os
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        raise ValueError(f"rank {os.environ['RANK']} cannot go on")

    main()
""")


def test_torchrun_structured_error_file(tmp_path: Path) -> None:
    """torchrun (its entry point is ``@record``) copies the failed worker's report to
    ``TORCHELASTIC_ERROR_FILE``, which rlsup points into the attempt's directory and reads at the end."""
    (tmp_path / "train.py").write_text(RECORDED_RAISE)
    inc = _one_incident(tmp_path, [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                                   "train.py"])
    report = tmp_path / ".rlsup" / "attempts" / "attempt_0000" / ERROR_FILE_NAME
    assert json.loads(report.read_text())["message"]["errorCode"] == 1
    assert (inc["reason"], inc["exit_code"], inc["rank"]) == ("exit_code", 1, 0), inc
    assert inc["detail"] == f"exit code 1 (rank 0, pid {inc['pid']}): ValueError: rank 0 cannot go on", inc["detail"]


def test_structured_report_preferred_and_other_subprocess_errors_ignored(tmp_path: Path) -> None:
    """The report's exit code wins over the output's (here: a signal the output does not show); a
    CalledProcessError that is not accelerate's launcher's names no rank."""
    report = tmp_path / ERROR_FILE_NAME
    report.write_text(json.dumps({"message": {"message": "Signal 11 (SIGSEGV)", "extraInfo": {}, "errorCode": -11}}))
    r = classify_exit(0, 1, tail=["whatever the launcher said"], last_step=None, job_pid=9, first_dead=None,
                      oom_rose=False, stop_reason=None, error_file=report)
    assert (r.reason, r.signal, r.exit_code) == (EndReason.SIGNAL, "SIGSEGV", 1), r
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    plain = classify_exit(0, 1, tail=[], last_step=None, job_pid=9, first_dead=None, oom_rose=False,
                          stop_reason=None, error_file=garbled)
    assert (plain.reason, plain.detail) == (EndReason.EXIT_CODE, "exit code 1")
    other = ["Traceback (most recent call last):", '  File "wrap.py", line 3, in <module>',
             "subprocess.CalledProcessError: Command '['python', 'x.py']' died with <Signals.SIGKILL: 9>."]
    assert accelerate_child_exit(other) is None
