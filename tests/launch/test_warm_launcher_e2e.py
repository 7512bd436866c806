"""The warm launcher: a restart of a torchrun job starts from a pre-spawned, pre-imported torchrun.

Real processes throughout: rlsup runs torchrun jobs whose ranks record who launched them (the
torchrun agent is each rank's parent), what they inherited, and the restart count.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from support.env import clean_env
from support.procs import pid_alive, run_rlsup, start_rlsup
from support.waits import wait_for

from supervisor.launch.warm_launcher import warm_spec

PY = sys.executable
TORCHRUN = str(Path(PY).parent / "torchrun")
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2"]

# Each rank writes who launched it and what it inherited; on attempt 0 rank 1 SIGKILLs itself.
CRASH_ONCE = """
import json, os, signal, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["RLSUP_RESTART_COUNT"])
agent = os.getppid()
with open(f"/proc/{agent}/cmdline", "rb") as f:
    agent_cmdline = f.read().decode().split("\\0")
info = {"agent": agent, "agent_cmdline": agent_cmdline, "cwd": os.getcwd(), "stdin": os.readlink("/proc/self/fd/0"),
        "restart_count": os.environ["RLSUP_RESTART_COUNT"], "pythonpath": os.environ.get("PYTHONPATH"),
        "leaked": sorted(k for k in os.environ if k.startswith("RLSUP_WARM")), "argv": sys.argv[1:]}
with open(f"{sys.argv[1]}.rank{rank}.attempt{attempt}.json", "w") as f:
    json.dump(info, f)
print(f"hello from rank {rank} attempt {attempt}", flush=True)
t = torch.ones(1)
dist.all_reduce(t)
if attempt == 0 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(t)
dist.destroy_process_group()
"""

# Writes a marker, then waits to be ended (exits 1 when told to through a file, on attempt 0 only).
WAITER = """
import os, sys, time
from pathlib import Path
attempt = int(os.environ["RLSUP_RESTART_COUNT"])
Path(sys.argv[1] + f".attempt{attempt}").write_text(str(os.getpid()))
while attempt == 0 and not Path(sys.argv[2]).exists():
    time.sleep(0.05)
sys.exit(1 if attempt == 0 and Path(sys.argv[2]).exists() else 0)
"""


def _job_children(rlsup_pid: int) -> list[int]:
    """rlsup's children but its guardian (supervisor.processes.guardian, one per run, never part of a job)."""
    return [c.pid for c in psutil.Process(rlsup_pid).children()
            if not any("supervisor.processes.guardian" in arg for arg in c.cmdline())]


def _zygotes(rlsup_pid: int) -> list[psutil.Process]:
    """rlsup's children that are warm launchers."""
    out = []
    try:
        for child in psutil.Process(rlsup_pid).children():
            try:
                if any(arg.endswith("supervisor/launch/warm_launcher.py") for arg in child.cmdline()):
                    out.append(child)
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return out


def _waiting_for_message(proc: psutil.Process) -> bool:
    """The zygote imported torchrun and closed its ready pipe: it now blocks reading its message."""
    try:
        cmdline = proc.cmdline()
        fd = cmdline[cmdline.index("--ready-fd") + 1]
        return not os.path.exists(f"/proc/{proc.pid}/fd/{fd}")
    except (psutil.Error, ValueError, IndexError):
        return False


def _spawned_pids(stderr: str) -> list[int]:
    return [int(line.split("warm launcher pid ")[1].split()[0]) for line in stderr.splitlines()
            if "warm launcher pid " in line and "spawned for the next attempt" in line]


def test_restart_starts_from_the_prespawned_launcher(workdir: Path) -> None:
    script = workdir / "crash_once.py"
    script.write_text(CRASH_ONCE)
    out = workdir / "info"
    # attempt 0 cold (--warm-first-attempt false): the yardstick of the warm attempt 1
    r = run_rlsup(["run", *FAST, "--max-restarts", "2", "--warm-first-attempt", "false", "--", TORCHRUN, "--standalone",
                   "--nproc-per-node", "2", str(script), str(out)], workdir, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    info = {p.name.split(".", 1)[1]: json.loads(p.read_text()) for p in workdir.glob("info.rank*.json")}
    assert sorted(info) == ["rank0.attempt0.json", "rank0.attempt1.json", "rank1.attempt0.json",
                            "rank1.attempt1.json"], sorted(info)
    spawned = _spawned_pids(r.stderr)
    assert len(spawned) == 2, r.stderr  # one during attempt 0, one during attempt 1 (for attempt 2)
    for rank in (0, 1):
        cold, warm = info[f"rank{rank}.attempt0.json"], info[f"rank{rank}.attempt1.json"]
        assert cold["agent_cmdline"][1:3] == [TORCHRUN, "--standalone"], cold  # the console script
        # ``-u``: the workers are started so, and ranks forked from the zygote keep its flags
        assert warm["agent_cmdline"][1] == "-u" and warm["agent_cmdline"][2].endswith(
            "supervisor/launch/warm_launcher.py"), warm
        # attempt 1's torchrun agent is the zygote spawned during attempt 0
        assert warm["agent"] == spawned[0]
        assert warm["restart_count"] == "1" and cold["restart_count"] == "0"
        # the workers inherit exactly what a cold launch gives them
        assert Path(warm["cwd"]).resolve() == workdir.resolve()
        assert warm["stdin"] == cold["stdin"] == "/dev/null"
        assert warm["pythonpath"] == cold["pythonpath"] and warm["leaked"] == []
        assert warm["argv"] == cold["argv"] == [str(out)]
    assert f"attempt 1: started by the warm launcher (pid {spawned[0]}" in r.stderr
    state = json.loads((workdir / ".rlsup" / "state.json").read_text())
    assert state["job_pid"] == spawned[0]
    # torchrun's root-cause report is read from the cold attempt as before
    inc = [json.loads(line) for line in (workdir / ".rlsup" / "incidents.jsonl").read_text().splitlines()]
    assert len(inc) == 1 and inc[0]["signal"] == "SIGKILL" and inc[0]["rank"] == 1
    # the warm attempt's output went to its own log
    log1 = (workdir / ".rlsup" / "attempts" / "attempt_0001" / "output.log").read_text()
    assert "hello from rank 0 attempt 1" in log1 and "attempt 0" not in log1
    # the zygote armed for attempt 2 was never used and did not outlive rlsup
    assert spawned[1] != spawned[0]
    wait_for(lambda: not pid_alive(spawned[1]), 10, "the unused warm launcher to be gone")


def test_dead_zygote_falls_back_to_cold_launch(workdir: Path) -> None:
    script = workdir / "waiter.py"
    script.write_text(WAITER)
    started, crash = workdir / "started", workdir / "crash"
    # attempt 0 cold (--warm-first-attempt false): the only warm launcher is the one armed for attempt 1
    proc = start_rlsup(["run", *FAST, "--max-restarts", "1", "--warm-first-attempt", "false", "--", PY, "-m",
                        "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script), str(started),
                        str(crash)], workdir)
    try:
        zygote = wait_for(lambda: _zygotes(proc.pid), 60, "a warm launcher")[0]
        zygote.kill()
        wait_for(lambda: Path(f"{started}.attempt0").exists(), 120, "attempt 0 to run")
        crash.touch()
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert f"warm launcher pid {zygote.pid} not usable" in out and "launching cold" in out
    assert Path(f"{started}.attempt1").exists()


def test_no_zygote_when_disabled(workdir: Path) -> None:
    """``--warm-launcher false``: no zygote beside attempt 0, so attempt 1 starts cold, and nothing says "warm"."""
    script = workdir / "waiter.py"
    script.write_text(WAITER)
    started, crash = workdir / "started", workdir / "crash"
    proc = start_rlsup(["run", *FAST, "--warm-launcher", "false", "--max-restarts", "1", "--", TORCHRUN,
                        "--standalone", "--nproc-per-node", "1", str(script), str(started), str(crash)], workdir)
    try:
        # The zygote would be spawned right after launch, long before the rank runs.
        wait_for(lambda: Path(f"{started}.attempt0").exists(), 120, "the rank to run")
        assert _zygotes(proc.pid) == []
        assert _job_children(proc.pid) == [
            json.loads((workdir / ".rlsup" / "state.json").read_text())["job_pid"]]
        crash.touch()  # attempt 0 fails; attempt 1 runs
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and Path(f"{started}.attempt1").exists(), out[-3000:]
    log1 = (workdir / ".rlsup" / "attempts" / "attempt_0001" / "output.log").read_text()
    assert not re.search(r"warm (launcher|ranks?)", out + log1), out[-3000:]  # (the test's paths say warm_)


def test_the_first_attempt_starts_from_a_launcher_spawned_for_it(workdir: Path) -> None:
    """The default: attempt 0 has no launcher waiting, so one is spawned for it and its ranks are forked from that
    launcher's one torch import (a cold torchrun's ranks import it each); with no restart left, none is armed
    for a next attempt."""
    script = workdir / "ranks.py"
    # one write per line: the two ranks share the pipe (print's separate writes could interleave)
    script.write_text("import os\nimport torch\nos.write(1, f\"rank {os.environ['RANK']} pid {os.getpid()}\\n\".encode())\n")
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}  # a user's: torchrun adds it for 2 ranks
    r = subprocess.run([sys.executable, "-m", "supervisor.cli.main", "run", *FAST,
                        "--max-restarts", "0", "--", TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script)],
                       cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (zygote,) = re.findall(r"warm launcher pid (\d+) spawned for this attempt", r.stderr)
    assert f"attempt 0: started by the warm launcher (pid {zygote}," in r.stderr, r.stderr[-3000:]
    assert "spawned for the next attempt" not in r.stderr, r.stderr[-3000:]  # --max-restarts 0: no next attempt
    log0 = (workdir / ".rlsup" / "attempts" / "attempt_0000" / "output.log").read_text()
    used = re.search(r"2 local rank\(s\) started from warm ranks \(pids (\d+), (\d+); forked from the launcher\)", log0)
    assert used is not None, log0[-3000:]
    ranks = {int(pid) for pid in re.findall(r"^rank \d pid (\d+)$", log0, re.M)}
    assert ranks == {int(used[1]), int(used[2])}, log0[-3000:]
    assert json.loads((workdir / ".rlsup" / "state.json").read_text())["job_pid"] == int(zygote)


def test_a_forked_rank_whose_own_excepthook_fails_still_fails(workdir: Path) -> None:
    """A trainer's exception whose own ``sys.excepthook`` raises too: the forked rank exits 1 as a cold one does,
    never falling back into its zygote's code (which would end it 0, a failed rank taken for a success)."""
    script = workdir / "bad_hook.py"
    script.write_text("import os, sys\nimport torch\n"
                      "def hook(*args):\n    raise OSError('the hook itself failed')\n"
                      "sys.excepthook = hook\n"
                      "if os.environ['RANK'] == '0':\n    raise ValueError('the trainer failed')\n")
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-m", "supervisor.cli.main", "run", *FAST, "--max-restarts", "0", "--",
                        TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script)],
                       cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    log0 = (workdir / ".rlsup" / "attempts" / "attempt_0000" / "output.log").read_text()
    assert "forked from the launcher" in log0, log0[-3000:]
    assert r.returncode != 0, r.stderr[-3000:]
    (inc,) = [json.loads(line) for line in (workdir / ".rlsup" / "incidents.jsonl").read_text().splitlines()]
    assert inc["rank"] == 0 and "exit code 1" in inc["detail"], inc


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_waiting_zygote_dies_with_rlsup(workdir: Path, sig: int) -> None:
    """SIGKILL: PR_SET_PDEATHSIG takes the zygote along; SIGTERM: rlsup stops and kills it on its way out."""
    script = workdir / "waiter.py"
    script.write_text(WAITER)
    started, crash = workdir / "started", workdir / "crash"
    # attempt 0 cold (--warm-first-attempt false): the only warm launcher is the one waiting for attempt 1
    proc = start_rlsup(["run", *FAST, "--warm-first-attempt", "false", "--", TORCHRUN, "--standalone",
                        "--nproc-per-node", "1", str(script), str(started), str(crash)], workdir)
    rank_pid = None
    try:
        zygote = wait_for(lambda: _zygotes(proc.pid), 60, "a warm launcher")[0]
        wait_for(lambda: _waiting_for_message(zygote), 120, "the warm launcher to wait for its message")
        rank_pid = int(wait_for(lambda: Path(f"{started}.attempt0").exists() and Path(f"{started}.attempt0")
                                .read_text(), 120, "the rank to run"))
        assert zygote.is_running() and zygote.pid in {c.pid for c in psutil.Process(proc.pid).children()}
    finally:
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM)
    wait_for(lambda: not pid_alive(zygote.pid), 10, "the warm launcher to die with rlsup")
    # torchrun's workers do not die with their agent; rlsup's guardian ends them (supervisor.processes.guardian)
    if rank_pid is not None:
        wait_for(lambda: not pid_alive(rank_pid), 5, "the rank to die with rlsup")


def test_non_torchrun_command_gets_no_zygote(workdir: Path) -> None:
    script = workdir / "waiter.py"
    script.write_text(WAITER)
    started, crash = workdir / "started", workdir / "crash"
    proc = start_rlsup(["run", *FAST, "--", PY, str(script), str(started), str(crash)], workdir)
    try:
        pid = int(wait_for(lambda: Path(f"{started}.attempt0").exists() and Path(f"{started}.attempt0")
                           .read_text(), 60, "the job to run"))
        assert _job_children(proc.pid) == [pid]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "warm launcher" not in out


def test_warm_spec_only_for_torchrun(tmp_path: Path) -> None:
    env = {"PATH": str(Path(PY).parent) + os.pathsep + os.environ.get("PATH", "")}
    spec = warm_spec(["torchrun", "--standalone", "train.py"], env, str(tmp_path))
    assert spec is not None and spec.mode == "script" and spec.argv0 == TORCHRUN
    assert spec.args == ["--standalone", "train.py"]
    with open(TORCHRUN) as f:  # the interpreter torchrun itself runs under
        assert spec.python == f.readline()[2:].strip()
    spec = warm_spec([PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "t.py"], env, str(tmp_path))
    assert spec is not None and spec.mode == "module" and spec.python == PY and spec.args[0] == "--nproc-per-node"
    assert warm_spec([PY, "train.py"], env, str(tmp_path)) is None
    assert warm_spec([PY, "-u", "-m", "torch.distributed.run", "t.py"], env, str(tmp_path)) is None
    assert warm_spec(["bash", "-c", "torchrun t.py"], env, str(tmp_path)) is None
    assert warm_spec(["/no/such/torchrun", "t.py"], env, str(tmp_path)) is None
    wrapper = tmp_path / "torchrun"  # a wrapper of the same name does more than call main(): cold
    wrapper.write_text("#!/bin/sh\nexec echo hi\n")
    wrapper.chmod(0o755)
    assert warm_spec([str(wrapper), "t.py"], env, str(tmp_path)) is None
    # pip's /bin/sh form for long interpreter paths
    pip_sh = tmp_path / "bin" / "torchrun"
    pip_sh.parent.mkdir()
    pip_sh.write_text(f"#!/bin/sh\n'''exec' \"{PY}\" \"$0\" \"$@\"\n' '''\nimport sys\n"
                      "from torch.distributed.run import main\n")
    pip_sh.chmod(0o755)
    spec = warm_spec([str(pip_sh), "t.py"], env, str(tmp_path))
    assert spec is not None and spec.python == PY


def test_zygote_runs_torchrun_like_the_console_script(workdir: Path) -> None:
    """The zygote's exit status and report are torchrun's (1 with the root-cause report naming the worker), in
    both of its forms (the console script, ``-m torch.distributed.run``). One cold run is the yardstick: both
    forms run the same ``main()`` when launched cold."""
    script = workdir / "fail.py"
    script.write_text("import sys\nprint('failing', flush=True)\nsys.exit(3)\n")
    env = clean_env()
    cold = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "1", str(script)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=120)
    assert "Root Cause" in cold.stderr and "exitcode  : 3" in cold.stderr
    from supervisor.launch.warm_launcher import Zygote

    for mode, launcher in (("script", [TORCHRUN]), ("module", [PY, "-m", "torch.distributed.run"])):
        spec = warm_spec(launcher, env, str(workdir))
        assert spec is not None and spec.mode == mode
        zygote = Zygote(spec, env)
        log_path = workdir / f"warm.{mode}.log"
        try:
            job = zygote.start(["--standalone", "--nproc-per-node", "1", str(script)], env, str(workdir),
                               log_path, 40, ready_timeout=120)
            assert job is not None, mode
            assert job.wait_exit(120) == cold.returncode == 1, mode
            job.output.join(5)
        finally:
            zygote.discard()
        log = log_path.read_text()
        assert "failing" in log and "Root Cause" in log and "exitcode  : 3" in log, (mode, log)


def test_zygote_that_cannot_import_torchrun_is_not_used(workdir: Path) -> None:
    """An interpreter without torch: the zygote exits, start() says so (None: launch cold), its error is kept."""
    from supervisor.launch.warm_launcher import WarmSpec, Zygote

    base = getattr(sys, "_base_executable", "")
    if not base or subprocess.run([base, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("needs an interpreter without torch")
    zygote = Zygote(WarmSpec(base, "", [], "module", str(workdir)), clean_env())
    assert zygote.start(["t.py"], clean_env(), str(workdir), workdir / "out.log", 40, ready_timeout=60) is None
    assert not zygote.alive() and "No module named 'torch'" in zygote.output_left
    assert not (workdir / "out.log").exists()
