"""Naming the culprit (issue 19): grouped stacks, pre_launch_check, offline triage with ``rlsup incidents``.
Real processes throughout: torchrun with four gloo ranks, a real failing health command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from support.env import JOBS
from support.incidents import incidents
from support.procs import run_rlsup

from supervisor import exit_codes
from rlsup_format.state_files import UNHEALTHY_NODES
from supervisor.membership import node_name
from supervisor.diagnosis.stack_groups import group_stacks, main_thread

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
    # (0.05 s apart) room on a loaded machine. rlsup's default launch: attempt 0's ranks forked from one torch import;
    # --max-restarts 1: one hang (one incident, asserted), so the last attempt arms no launcher it never uses.
    r = run_rlsup(["run", *FAST, "--heartbeat-timeout", "4", "--max-restarts", "1", "--", PY, "-m",
                   "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "4", str(JOBS / "odd_rank_out_job.py")], workdir, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["reason"] == "hang" and len(inc["stacks"]) == 4, inc
    assert inc["suspect_ranks"] == [3] and inc["suspect_nodes"] == [node_name()], inc["verdict"]
    assert inc["verdict"].startswith("ranks 0-2 wait in `") and "rank 3 is in `load_batch` (odd_rank_out_job.py:" \
        in inc["verdict"] and inc["verdict"].endswith(f"suspect rank 3 on node {node_name()}")
    assert f"suspect rank 3 on node {node_name()}" in r.stderr  # the log leads with it
    status = subprocess.run([PY, "-m", "supervisor.cli.main", "status"], cwd=workdir, capture_output=True, text=True,
                            timeout=60)
    assert "suspect rank 3" in status.stdout, status.stdout

    triage = subprocess.run([PY, "-m", "supervisor.cli.main", "incidents", str(workdir / ".rlsup")], capture_output=True,
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
    out = subprocess.run([PY, "-m", "supervisor.cli.main", "incidents", "--json", str(workdir / ".rlsup" / "incidents.jsonl")],
                         capture_output=True, text=True, timeout=60)
    data = json.loads(out.stdout)
    assert data["summary"]["incidents"] == 2 and data["summary"]["restarts"] == 2
    assert data["summary"]["reasons"] == {"exit_code": 2}
    first, second = data["incidents"]  # a one-node job: its node failing again is named by no one
    assert first["suspect_nodes"] == [] and second["suspect_nodes"] == [] and second["verdict"] == ""
    assert data["summary"]["suspect_nodes"] == {}
    missing = subprocess.run([PY, "-m", "supervisor.cli.main", "incidents", str(workdir / "nope")], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 1 and "no incidents.jsonl" in missing.stderr


# ------------------------------------------------------------ a hang seen in the output names the stuck trainer

def _hangs(workdir: Path) -> list[dict]:
    return [i for i in incidents(workdir / ".rlsup") if i["reason"] == "hang"]


def test_a_sigstopped_torchrun_rank_is_named_with_its_rank_cold_and_warm_started(workdir: Path) -> None:
    """No trainer_hooks: the hang is seen in the output (the job-level record, whose pid is torchrun's agent).
    Rank 1 stops itself in attempt 0 (cold: its RANK is in /proc/PID/environ) and in attempt 1 (started by the
    warm launcher: its environ is the warm rank's, the rank comes from the warm rank's own record)."""
    # 10 s: the job's own end (the ranks' exit, then the agent's) is not paced by steps, and the warm launcher armed
    # beside each attempt slows it on a loaded machine; a tighter timeout took it for a hang
    # --max-restarts 2: the two hangs (attempt 2 arms no warm launcher it would never use)
    # --warm-first-attempt false: attempt 0 cold, as the test's subject asks
    r = run_rlsup(["run", *FAST, "--max-restarts", "2", "--warm-first-attempt", "false", "--heartbeat-timeout", "10",
                   "--progress-regex", r"^step (\d+)",
                   "--", PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(JOBS / "stopped_rank_job.py"), "ranks", "0,1"], workdir, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "attempt 1: started by the warm launcher" in r.stderr, r.stderr[-3000:]
    stopped = [int(p) for p in re.findall(r"rank 1 pid (\d+) stopping", r.stdout)]
    hangs = _hangs(workdir)
    assert len(stopped) == 2 and len(hangs) == 2, (stopped, hangs)
    for inc, pid in zip(hangs, stopped):
        assert (inc["rank"], inc["pid"]) == (1, pid), inc  # the stopped rank, never torchrun's agent
        assert inc["verdict"].startswith(f"stuck: rank 1 (pid {pid}): stopped"), inc["verdict"]
        assert inc["suspect_ranks"] == [1] and f"rank 1 pid {pid}" in inc["stacks"], list(inc["stacks"])
        assert any(key.startswith("launcher pid ") for key in inc["stacks"]), list(inc["stacks"])


def test_a_hung_trainer_run_as_a_child_is_named_not_its_cli_parent(workdir: Path) -> None:
    """One process whose Python runs the trainer as a child (one-process ``trl sft``): the child is the culprit,
    rank 0 (the job's only trainer, in no distributed world)."""
    r = run_rlsup(["run", *FAST, "--heartbeat-timeout", "6", "--progress-regex",
                   r"^step (\d+)", "--", PY, str(JOBS / "stopped_rank_job.py"), "child"], workdir, timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    launcher = int(re.findall(r"launcher pid (\d+)", r.stdout)[0])
    trainer = int(re.findall(r"trainer pid (\d+)", r.stdout)[0])
    (inc,) = _hangs(workdir)
    assert (inc["rank"], inc["pid"]) == (0, trainer) and inc["pid"] != launcher, inc
    assert f"stuck: rank 0 (pid {trainer}): the job's only trainer process" in inc["detail"], inc["detail"]
    assert "stuck_here" in inc["stacks"][f"rank 0 pid {trainer}"], inc["stacks"]
    assert f"launcher pid {launcher} (" in " ".join(inc["stacks"]), list(inc["stacks"])


def test_the_culprit_is_a_stopped_or_singled_out_trainer_never_a_launcher_or_helper() -> None:
    from supervisor.diagnosis.stacks import FILESYSTEM_NOTE, STOPPED_NOTE, culprit

    stopped = f"{STOPPED_NOTE}\n" + PYSPY
    base = {"launcher pid 10 (python -m torch.distributed.run)": stopped, "rank 0 pid 11": PYSPY,
            "pid 13 (helper of pid 11: python train.py)": stopped}
    assert culprit(base) is not None and culprit(base).pid == 11  # the only trainer; the stopped others are not ones
    assert culprit(base).singled_out is False
    two = {**base, "rank 1 pid 12": stopped}
    assert (culprit(two).rank, culprit(two).pid, culprit(two).why.startswith("stopped")) == (1, 12, True)
    fs = {**base, "rank 1 pid 12": f"{FILESYSTEM_NOTE}\n" + PYSPY}
    assert culprit(fs).pid == 12 and "filesystem" in culprit(fs).why
    running = {**base, "rank 1 pid 12": PYSPY}
    assert culprit(running) is None  # two trainers, nothing sets one apart: nobody is named
    assert culprit(running, suspects=[1]).pid == 12
    assert culprit({"pid 20 (python train.py)": PYSPY}).rank is None  # no source told its rank


def test_tree_roles_read_ranks_from_the_environment_the_warm_record_and_the_command_line(tmp_path: Path) -> None:
    """Real processes: a CLI parent running three trainers (one with RANK in its environment, one whose rank only
    its warm-rank record tells, one with --local_rank), one of them with a forked worker; and a fork of the parent
    itself with a warm-rank record (a rank forked from the warm launcher shows the launcher's command line until it
    writes the worker's): a rank, not a helper."""
    import psutil

    from supervisor.diagnosis.stacks import tree_roles
    from rlsup_format.state_files import WARM_RANK_RECORD
    from support.waits import wait_for

    child = ("import os, sys, time\n"
             "if sys.argv[1] == 'fork' and os.fork() == 0:\n"
             "    time.sleep(60)\n"
             "time.sleep(60)\n")
    parent = (f"import os, subprocess, sys, time\nc = {child!r}\n"
              "env = dict(os.environ, RANK='0', WORLD_SIZE='3')\n"
              "ps = [subprocess.Popen([sys.executable, '-c', c, 'fork'], env=env),\n"
              "      subprocess.Popen([sys.executable, '-c', c, 'warm'], env=dict(os.environ, WORLD_SIZE='3')),\n"
              "      subprocess.Popen([sys.executable, '-c', c, 'x', '--local_rank=2'])]\n"
              "if os.fork() == 0:\n"
              "    time.sleep(60)\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([PY, "-c", parent])
    try:
        root = psutil.Process(proc.pid)
        wait_for(lambda: len(root.children(recursive=True)) == 5, 30, "three trainers, a forked worker, a fork")
        tree = [root, *root.children(recursive=True)]
        warm = next(p for p in root.children() if "warm" in p.cmdline())
        forked = next(p for p in root.children() if p.cmdline() == root.cmdline())
        for pid, rank in ((warm.pid, 1), (forked.pid, 3)):
            (tmp_path / WARM_RANK_RECORD.format(pid=pid)).write_text(json.dumps({"pid": pid, "rank": rank}))
        roles = {r.pid: r for r in tree_roles(tree, tmp_path)}
        assert roles[proc.pid].kind == "launcher" and roles[proc.pid].key().startswith(f"launcher pid {proc.pid} (")
        by_rank = {r.rank: r for r in roles.values() if r.kind == "trainer"}
        assert {k: v.rank_from for k, v in by_rank.items()} == {0: "RANK", 1: "warm rank record", 2: "cmdline",
                                                                3: "warm rank record"}
        assert by_rank[3].pid == forked.pid
        (helper,) = [r for r in roles.values() if r.kind == "helper"]
        assert helper.parent == by_rank[0].pid and "helper of pid" in helper.key()
    finally:
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        proc.kill()
        proc.wait(10)
