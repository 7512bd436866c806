"""Naming the culprit (issue 19): grouped stacks, pre_launch_check, offline triage with ``rlsup incidents``.
Real processes throughout: torchrun with four gloo ranks, a real failing health command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.env import JOBS
from support.incidents import incidents
from support.procs import run_rlsup

from supervisor import exit_codes
from supervisor.health import UNHEALTHY_NODES, node_name
from supervisor.stack_groups import group_stacks, main_thread

PY = sys.executable
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2"]

FAULTHANDLER = """Thread 0x00007fa418a436c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007fa4195d8b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line {line} in all_reduce
  File "/work/train.py", line 120 in train_step
  File "/work/train.py", line 200 in <module>
"""
PYSPY = """Process 4242: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4242 (idle): "MainThread"
    load_batch (/work/data.py:55)
    train_step (/work/train.py:118)
    <module> (/work/train.py:200)
Thread 4250 (idle): "pin_memory"
    wait (threading.py:320)
    _bootstrap (threading.py:1002)
"""


def test_stacks_group_by_function_not_line_and_name_the_odd_rank() -> None:
    stacks = {f"rank {r} pid {100 + r}": FAULTHANDLER.format(line=2050 + r) for r in (0, 1, 2, 4, 5, 6, 7)}
    stacks["rank 3 pid 103"] = PYSPY
    verdict = group_stacks(stacks, node="n1")
    assert [g.ranks for g in verdict.groups] == [[0, 1, 2, 4, 5, 6, 7], [3]] and verdict.suspects == [3]
    assert verdict.describe() == ("ranks 0-2, 4-7 wait in `all_reduce` (train.py:120); rank 3 is in `load_batch` "
                                  "(data.py:55): suspect rank 3 on node n1")
    assert main_thread(PYSPY)[0].func == "load_batch"


def test_no_suspect_without_a_majority() -> None:
    stacks = {"rank 0 pid 1": FAULTHANDLER.format(line=1), "rank 1 pid 2": PYSPY}
    assert group_stacks(stacks).suspects == []
    assert group_stacks({f"rank {r} pid {r}": PYSPY for r in range(4)}).suspects == []


def test_four_rank_hang_names_the_rank_stuck_elsewhere(workdir: Path) -> None:
    # The timeout only decides when the stuck attempt is ended; 4 s of silence still leaves the healthy steps
    # (0.05 s apart) room on a loaded machine. --warm-launcher false: the hang is in attempt 0, which starts cold
    # anyway; the 4 warm ranks armed beside it (about 15 s of CPU) only served the restart after it.
    r = run_rlsup(["run", *FAST, "--heartbeat-timeout", "4", "--warm-launcher", "false", "--", PY, "-m",
                   "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "4", str(JOBS / "odd_rank_out_job.py")], workdir, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["reason"] == "hang" and len(inc["stacks"]) == 4, inc
    assert inc["suspect_ranks"] == [3] and inc["suspect_nodes"] == [node_name()], inc["verdict"]
    assert inc["verdict"].startswith("ranks 0-2 wait in `") and "rank 3 is in `load_batch` (odd_rank_out_job.py:" \
        in inc["verdict"] and inc["verdict"].endswith(f"suspect rank 3 on node {node_name()}")
    assert f"suspect rank 3 on node {node_name()}" in r.stderr  # the log leads with it
    status = subprocess.run([PY, "-m", "supervisor.cli", "status"], cwd=workdir, capture_output=True, text=True,
                            timeout=60)
    assert "suspect rank 3" in status.stdout, status.stdout

    triage = subprocess.run([PY, "-m", "supervisor.cli", "incidents", str(workdir / ".rlsup")], capture_output=True,
                            text=True, timeout=60)
    assert triage.returncode == 0, triage.stderr
    assert "1 incident(s)" in triage.stdout and "1 restart(s)" in triage.stdout, triage.stdout
    assert f"suspect nodes: {node_name()} (1x)" in triage.stdout and "hang -> restart" in triage.stdout
    assert "suspect rank 3" in triage.stdout


def test_failing_pre_launch_check_stops_with_the_node_named(workdir: Path) -> None:
    check = "echo 'GPU 3: Xid 79 fallen off the bus' >&2; exit 3"
    r = run_rlsup(["run", *FAST, "--pre-launch-check", check, "--", PY, "-c", "raise SystemExit('never launched')"],
                  workdir)
    assert r.returncode == exit_codes.UNHEALTHY == 77, r.stderr
    assert f"node {node_name()} is unhealthy: pre_launch_check exited 3 (GPU 3: Xid 79 fallen off the bus)" in r.stderr
    assert "never launched" not in r.stdout + r.stderr
    (inc,) = incidents(workdir / ".rlsup")
    assert (inc["reason"], inc["action"], inc["suspect_nodes"]) == ("unhealthy", "exclude_node", [node_name()])
    assert (workdir / ".rlsup" / UNHEALTHY_NODES).read_text() == node_name() + "\n"


def test_pre_launch_check_timeout_and_pass(workdir: Path) -> None:
    r = run_rlsup(["run", *FAST, "--pre-launch-check", "sleep 30", "--pre-launch-timeout", "1", "--", PY, "-c", "0"],
                  workdir)
    assert r.returncode == 77 and "pre_launch_check timed out after 1s" in r.stderr, r.stderr
    ok = run_rlsup(["run", *FAST, "--state-dir", "ok-state", "--pre-launch-check", "test -d .", "--", PY, "-c", "0"],
                   workdir)
    assert ok.returncode == 0, ok.stderr


def test_incidents_json_and_missing_file(workdir: Path) -> None:
    r = run_rlsup(["run", *FAST, "--", PY, str(JOBS / "exit_codes_job.py"), "3,3,0"], workdir)
    assert r.returncode == 0, r.stderr
    out = subprocess.run([PY, "-m", "supervisor.cli", "incidents", "--json", str(workdir / ".rlsup" / "incidents.jsonl")],
                         capture_output=True, text=True, timeout=60)
    data = json.loads(out.stdout)
    assert data["summary"]["incidents"] == 2 and data["summary"]["restarts"] == 2
    assert data["summary"]["reasons"] == {"exit_code": 2}
    first, second = data["incidents"]  # a one-node job: its node failing again is named by no one
    assert first["suspect_nodes"] == [] and second["suspect_nodes"] == [] and second["verdict"] == ""
    assert data["summary"]["suspect_nodes"] == {}
    missing = subprocess.run([PY, "-m", "supervisor.cli", "incidents", str(workdir / "nope")], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 1 and "no incidents.jsonl" in missing.stderr
