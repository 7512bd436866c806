"""Nothing of an attempt outlives it, however rlsup dies (issue 28): real processes and signals.

- ``kill -9`` of rlsup: the guardian ends the attempt's tree (a shell's background children, an
  unmodified 2-rank torchrun job) within 5 s;
- no guardian (and, forced, no cgroup): the next ``rlsup run`` in the same state directory ends the
  leftovers (a setsid-daemonised one included) before it launches, and names them in the incident;
- a job root that dies: its children are killed before its output is drained and classified;
- a job's own exit code that is one of rlsup's (75, 76, 77, 2) becomes 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.env import ROOT, clean_env
from support.incidents import incidents
from support.ports import free_ports
from support.procs import pid_alive, run_rlsup, start_rlsup
from support.waits import wait_for
from supervisor import exit_codes
from supervisor.processes.cgroup import create_run_cgroup, remove_cgroup
from supervisor.processes.tree_record import load, record_path

PY = sys.executable
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--poll-interval", "0.05"]


def _cgroups_here() -> bool:
    probe = create_run_cgroup(f"rlsup-test-probe.{os.getpid()}")
    return probe is not None and remove_cgroup(probe)


CGROUPS = _cgroups_here()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _recorded(state_dir: Path, *commands: str) -> dict[str, int]:
    """Pids of the run's record (roots and pids seen) whose command line is each of ``commands`` (a
    trailing ``*``: starts with it); {} until all are there."""
    record = load(record_path(state_dir))
    if record is None:
        return {}
    found = {}
    for pid in [r.pid for r in record.roots] + [p.pid for p in record.pids]:
        line = _cmdline(pid)
        for command in commands:
            if line == command or (command.endswith("*") and line.startswith(command[:-1])):
                found[command] = pid
    return found if len(found) == len(commands) else {}


def _all_dead(pids: list[int]) -> bool:
    return not any(pid_alive(p) for p in pids)


def _kill9_and_expect_tree_gone(proc: subprocess.Popen, pids: list[int]) -> None:
    assert all(pid_alive(p) for p in pids), "the attempt must be running before rlsup is killed"
    proc.kill()
    proc.wait(timeout=10)
    wait_for(lambda: _all_dead(pids), 5.0, f"every process of the attempt ({pids}) gone after rlsup's SIGKILL")


def test_kill9_of_rlsup_ends_a_shells_background_children(workdir: Path) -> None:
    proc = start_rlsup(["run", *FAST, "--checkpoint-dir", "ckpt", "--", "sh", "-c", "sleep 311 & sleep 312; wait"],
                       workdir)
    try:
        found = wait_for(lambda: _recorded(workdir / ".rlsup", "sleep 311", "sleep 312", "sh -c *"), 20,
                         "both sleeps recorded")
        if CGROUPS:  # the job's processes live in the run's group, below rlsup's own
            assert "/rlsup." in Path(f"/proc/{found['sleep 311']}/cgroup").read_text()
        _kill9_and_expect_tree_gone(proc, list(found.values()))
        guard_log = workdir / ".rlsup" / "attempt_guard.log"
        # polls: the deadline only bounds a loaded machine (CI once took over 10 s for the run record below)
        log = wait_for(lambda: guard_log.exists() and guard_log.read_text(), 30, "the guardian's log line")
        assert str(found["sleep 311"]) in log and str(found["sleep 312"]) in log, log
        assert ("(cgroup)" in log) == CGROUPS, log  # killed as a unit where a group could be made
    finally:
        proc.kill()


TRAINER = """\
import os, sys, time
open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.pid"), "w").write(str(os.getpid()))
while True:
    print("rank", os.environ["RANK"], "alive", flush=True)
    time.sleep(0.1)
"""


def test_kill9_of_rlsup_ends_an_unmodified_torchrun_job(workdir: Path) -> None:
    """2 ranks that never import trainer_hooks (so no rank arms die-with-parent itself)."""
    (workdir / "train.py").write_text(TRAINER)
    torchrun = str(Path(PY).parent / "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("no torchrun in this environment")
    port = free_ports(1)[0]
    proc = start_rlsup(["run", *FAST, "--warm-launcher", "false", "--checkpoint-dir", "ckpt", "--", torchrun,
                        "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                        "train.py", str(workdir)], workdir)
    try:
        ranks = wait_for(lambda: [int((workdir / f"rank{r}.pid").read_text()) for r in (0, 1)]
                         if all((workdir / f"rank{r}.pid").exists() for r in (0, 1)) else None, 90, "both ranks up")
        # a poll: the deadline only bounds a loaded machine (10 s was missed once, the ranks already up)
        root = wait_for(lambda: _recorded(workdir / ".rlsup", f"{PY} {torchrun} *"), 60, "torchrun recorded")
        root = root[f"{PY} {torchrun} *"]
        _kill9_and_expect_tree_gone(proc, [root, *ranks])
    finally:
        proc.kill()


DRIVER = """\
import logging, sys
sys.path.insert(0, {root!r})
from supervisor.config import SupervisorConfig
from supervisor.processes.job import OsProcesses
from supervisor.run.loop import Supervisor
logging.basicConfig(level=logging.INFO)
cfg = SupervisorConfig(checkpoint_dir={ckpt!r}, state_dir={state!r}, metrics_port=0, poll_interval=0.05)
layer = OsProcesses(cgroups={cgroups!r}, guardian={guardian!r})
sys.exit(Supervisor(cfg, sys.argv[1:], processes=layer).run().exit_code)
"""


def _start_driver(workdir: Path, cgroups: bool, guardian: bool) -> subprocess.Popen:
    """rlsup's run loop over an OsProcesses built here (the fallback forced by its constructor, not by
    the environment), running a shell with a daemonised ``sleep 313`` and a background ``sleep 314``."""
    driver = workdir / "driver.py"
    driver.write_text(DRIVER.format(root=str(ROOT), ckpt=str(workdir / "ckpt"), state=str(workdir / ".rlsup"),
                                    cgroups=cgroups, guardian=guardian))
    job = ["sh", "-c", "(setsid sleep 313 &); sleep 314 & wait"]
    return subprocess.Popen([PY, str(driver), *job], cwd=workdir, env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def test_kill9_guardian_fallback_without_cgroup_ends_a_daemonised_child(workdir: Path) -> None:
    """No cgroup (as where none can be made): the guardian ends the recorded pids and the root's session."""
    proc = _start_driver(workdir, cgroups=False, guardian=True)
    try:
        found = wait_for(lambda: _recorded(workdir / ".rlsup", "sleep 313", "sleep 314"), 20, "both sleeps recorded")
        assert load(record_path(workdir / ".rlsup")).cgroup is None  # type: ignore[union-attr]
        _kill9_and_expect_tree_gone(proc, list(found.values()))
    finally:
        proc.kill()


# The successor's job: exit 9 if any leftover still runs (a zombie is dead: pid 1 may be slow to reap).
ALIVE_CHECK = """\
import sys
def running(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False
sys.exit(9 if any(running(int(p)) for p in sys.argv[1:]) else 0)
"""


@pytest.mark.parametrize("cgroups", [False, pytest.param(True, marks=pytest.mark.skipif(
    not CGROUPS, reason="no cgroup v2 group can be made here"))], ids=["fallback", "cgroup"])
def test_next_rlsup_ends_what_a_dead_one_left_before_it_launches(workdir: Path, cgroups: bool) -> None:
    """No guardian: only the successor can end the leftovers. ``sleep 313`` daemonised (double fork +
    setsid: out of the job's session and tree), so only the cgroup or the recorded pids find it."""
    state = workdir / ".rlsup"
    proc = _start_driver(workdir, cgroups=cgroups, guardian=False)
    try:
        found = wait_for(lambda: _recorded(state, "sleep 313", "sleep 314"), 20, "both sleeps recorded")
        record = load(record_path(state))
        assert record is not None and (record.cgroup is not None) == cgroups
        assert _cmdline(found["sleep 313"]) and os.getsid(found["sleep 313"]) == found["sleep 313"]  # its own session
        proc.kill()
        proc.wait(timeout=10)
        assert all(pid_alive(p) for p in found.values()), "without a guardian the leftovers outlive rlsup"
        r = run_rlsup(["run", *FAST, "--max-restarts", "0", "--checkpoint-dir", str(workdir / "ckpt"), "--", PY, "-c",
                       ALIVE_CHECK, *map(str, found.values())], workdir, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]  # the successor's job saw none of them alive at launch
        assert _all_dead(list(found.values()))
        (lost,) = [i for i in incidents(state) if i["reason"] == "supervisor_lost"]
        for pid in found.values():
            assert str(pid) in lost["detail"], lost["detail"]
        assert "ended what its attempt left" in r.stderr, r.stderr[-3000:]
    finally:
        proc.kill()
        for pid in (found.values() if "found" in locals() else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


CHILD = """\
import sys, time
while True:
    with open(sys.argv[1], "a") as f:
        f.write(f"{time.time()}\\n")
    print("child still training", flush=True)
    time.sleep(0.02)
"""


def test_children_die_with_their_job_root_before_the_output_is_drained(workdir: Path) -> None:
    """The root (sh) is SIGKILLed; its child, holding the output pipe, is killed before the attempt is
    classified: its last tick precedes the incident, and it is gone right after the root."""
    (workdir / "child.py").write_text(CHILD)
    ticks, root_died = workdir / "ticks", workdir / "root_died"
    job = f"{PY} child.py {ticks} & echo $! > child.pid; sleep 0.5; {PY} -c 'import time; print(time.time())' " \
          f"> {root_died}; kill -9 $$"
    r = run_rlsup(["run", *FAST, "--max-restarts", "0", "--checkpoint-dir", "ckpt", "--", "sh", "-c", job], workdir,
                  timeout=60)
    child = int((workdir / "child.pid").read_text())
    wait_for(lambda: not pid_alive(child), 2, "the child gone")
    assert r.returncode == 1, r.stderr[-3000:]
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["signal"] == "SIGKILL"
    last_tick = float(ticks.read_text().split()[-1])
    died = float(root_died.read_text())
    assert last_tick < inc["time"], (last_tick, inc["time"])  # killed before the attempt was classified
    assert last_tick - died < 1.5, (last_tick, died)  # today's 2 s output join would have let it run on
    assert "killed what it left" in r.stderr, r.stderr[-3000:]


def test_exit_code_rule() -> None:
    assert [exit_codes.for_job_code(c) for c in (2, 75, 76, 77)] == [1, 1, 1, 1]
    assert [exit_codes.for_job_code(c) for c in (1, 3, 74, 78, 125)] == [1, 3, 74, 78, 125]
    assert [exit_codes.for_job_code(c) for c in (None, 0, -9, 126, 137)] == [1, 1, 1, 1, 1]


def test_a_jobs_code_that_is_one_of_rlsups_own_becomes_1(workdir: Path) -> None:
    code = exit_codes.NO_PROGRESS
    r = run_rlsup(["run", *FAST, "--max-restarts", "0", "--checkpoint-dir", "ckpt", "--", PY, "-c",
                   f"raise SystemExit({code})"], workdir, timeout=60)
    assert r.returncode == 1, r.stderr[-3000:]
    assert f"the job's exit code {code} is one of rlsup's own: exiting 1" in r.stderr
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["exit_code"] == code
    state = json.loads((workdir / ".rlsup" / "state.json").read_text())
    assert state["exit_code"] == 1


def test_an_ordinary_job_code_still_passes_through(workdir: Path) -> None:
    r = run_rlsup(["run", *FAST, "--max-restarts", "0", "--checkpoint-dir", "ckpt", "--", PY, "-c",
                   "raise SystemExit(74)"], workdir, timeout=60)
    assert r.returncode == 74, r.stderr[-3000:]
