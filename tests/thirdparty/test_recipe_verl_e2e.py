"""The verl recipe of issue 20, on CPU: ``rlsup run --checkpoint-layout verl --repair-tracker true
--progress verl -- <trainer>`` around an unmodified trainer that saves and resumes through verl 0.9.1's
own code (``tests/jobs/verl_driver.py``: FSDP on gloo, ``FSDPCheckpointManager``, ``data.pt``, the
tracker, ``find_latest_ckpt_path``, ``LocalLogger``).

The two SIGKILLs mid-save share one recipe run (``killed_twice``, kill points named by file, kill_matrix's hook;
each test asserts on its own attempt):

* SIGKILL before ``data.pt`` (attempt 0): step 4 is incomplete; rlsup resumes from 2 and leaves the tracker alone.
* SIGKILL just before verl writes the tracker for step 4 (attempt 1, which resumed from 2 and saved step 4 again):
  every file of step 4 is on disk but the tracker still says 2, so verl alone would redo steps. rlsup picks step
  4, rewrites the tracker (old kept as ``.rlsup-prev``), verl's own resume loads 4.
* A torn tracker (what a kill between ``open("w")`` and ``write`` leaves) over steps 2 and 4 of that run: verl's own
  resume raises on it at every restart; rlsup repairs it to the newest valid step before launch.
* A freeze: the job stops printing ``step:N - ...``; rlsup calls it a hang with stacks and restarts.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import kill_matrix
from support.env import JOBS, clean_env
from support.incidents import incidents
from support.ports import free_ports
from support.procs import rlsup_cmd

# verl runs in the driver's processes, not here: found, not imported (its import costs each collecting worker ~3 s)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is not installed")

TRACKER = "latest_checkpointed_iteration.txt"
DRIVER = JOBS / "verl_driver.py"
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "3"]
# The kill of each attempt of ``killed_twice``, named by what it is (no recording run to count events first): rank 0
# dies just before its n-th open for writing of a path ending so. Attempt 1 resumed from step 2: its first tracker
# write is step 4's.
KILLS = {0: kill_matrix.kill_at_match("open", "global_step_4/data.pt", 1),
         1: kill_matrix.kill_at_match("open", TRACKER, 1)}


def driver_cmd(ckpt: Path, total: int, *extra: str, ranks: int = 2) -> list[str]:
    """torchrun on CPU ranks, verl's trainer.* settings as driver flags. The kill runs use one rank (only rank 0,
    verl's single controller, writes ``data.pt`` and the tracker; a second would only cost its start)."""
    (port,) = free_ports(1)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(port),
            str(DRIVER), "--default-local-dir", str(ckpt), "--total-steps", str(total), "--save-freq", "2",
            *extra]


def rlsup_verl(workdir: Path, ckpt: Path, job: list[str], *flags: str) -> list[str]:
    """The recipe's command line."""
    return rlsup_cmd("run", *FAST, "--checkpoint-dir", str(ckpt), "--checkpoint-layout", "verl",
                     "--repair-tracker", "true", "--progress", "verl", "--startup-timeout", "300",
                     # The kills are SIGKILLs: no test but the freeze one wants a hang. 30 s was once too short for
                     # the driver's silent final save and teardown with three test workers on 2 cores.
                     "--heartbeat-timeout", "120", *flags, "--", *job)


@dataclass(frozen=True)
class KilledRun:
    """The recipe run of ``killed_twice``: where it ran, its checkpoints and its output."""

    workdir: Path
    ckpt: Path
    result: subprocess.CompletedProcess

    def events(self, attempt: int) -> list[kill_matrix.FileEvent]:
        """Rank 0's counted file events under the checkpoint dir in ``attempt`` (the agent writes none there)."""
        return kill_matrix.read_events(self.workdir / f"events-{attempt}.tsv")

    def log_until_launch(self, attempt: int) -> str:
        """rlsup's log from attempt ``attempt - 1``'s launch to attempt ``attempt``'s launch line, included: what
        it did between the two (a tracker repair is logged before the launch it serves)."""
        log = self.result.stderr
        start = log.index(f"attempt {attempt - 1}: launching")
        end = log.index("\n", log.index(f"attempt {attempt}: launching"))
        return log[start:end]


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory: pytest.TempPathFactory) -> KilledRun:
    """One recipe run to step 6, one rank, SIGKILLed in attempts 0 and 1 (``KILLS``); attempt 2 completes. One run
    for both kills: each was a run of its own, with a cold start of torchrun and verl more, and a recording run."""
    workdir = tmp_path_factory.mktemp("verl-killed-twice")
    ckpt = workdir / "ckpt"
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(kill_matrix._hook_dir()), env["PYTHONPATH"]])
    env[kill_matrix.EVENTS_UNDER] = str(ckpt.resolve())
    env[kill_matrix.ONLY_WHERE] = "RANK"
    # Each attempt logs its events to its own file; only attempts 0 and 1 get a kill (rlsup itself never does: no
    # kill variable in its env).
    cases = " ".join(f"{n}) export {shlex.join(f'{k}={v}' for k, v in kill.items())};;" for n, kill in KILLS.items())
    events = shlex.quote(str(workdir / "events-"))
    wrapper = ["bash", "-c", f'case "$RLSUP_RESTART_COUNT" in {cases} esac; '
               f'export {kill_matrix.EVENTS_LOG}={events}"$RLSUP_RESTART_COUNT.tsv"; exec "$@"', "_"]
    r = subprocess.run(rlsup_verl(workdir, ckpt, [*wrapper, *driver_cmd(ckpt, 6, ranks=1)]), cwd=workdir, env=env,
                       capture_output=True, text=True, timeout=600)
    return KilledRun(workdir, ckpt, r)


def verl_resume_pick(ckpt: Path) -> str:
    """What verl's own ``find_latest_ckpt_path`` returns (or raises) on this directory. Called here: it only reads
    the tracker, and this module imported verl already (a fresh process to import it again cost 8 s of CPU)."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    try:
        return str(find_latest_ckpt_path(str(ckpt)))
    except Exception as e:  # what verl raises is the answer
        return f"raised {type(e).__name__}"


def assert_completed(r: subprocess.CompletedProcess, ckpt: Path, total: int = 6) -> None:
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-4000:])
    assert f"training done at step {total}" in r.stdout and f"step:{total} - " in r.stdout
    assert (ckpt / TRACKER).read_text() == str(total)


def test_sigkill_before_data_pt_resumes_from_the_previous_step(killed_twice: KilledRun) -> None:
    """Attempt 0 of ``killed_twice``: killed before step 4's ``data.pt``."""
    run, ckpt = killed_twice, killed_twice.ckpt
    assert_completed(run.result, ckpt)
    events = run.events(0)
    assert events and events[-1].event == "open" and events[-1].path == str(ckpt / "global_step_4" / "data.pt"), \
        [e.describe() for e in events]  # attempt 0 died there, step 4's actor files written
    assert any(e.path.startswith(str(ckpt / "global_step_4" / "actor")) for e in events), [e.describe() for e in events]
    log = run.log_until_launch(1)
    assert "from step 2 (" in log and "now points at" not in log, log[-4000:]  # the tracker (2) was right
    assert f"Resuming from {ckpt}/global_step_2" in run.result.stdout
    # The run's only tracker repair is attempt 1's kill's (below), from the 2 verl itself wrote.
    assert run.result.stderr.count("now points at") == 1, run.result.stderr[-4000:]
    assert incidents(run.workdir / ".rlsup")[0]["resumed_step"] == 2


def test_sigkill_before_the_tracker_write_resumes_from_the_complete_step(killed_twice: KilledRun) -> None:
    """Attempt 1 of ``killed_twice``: resumed from step 2, saved step 4 again, killed before the tracker write."""
    run, ckpt = killed_twice, killed_twice.ckpt
    assert_completed(run.result, ckpt)
    events = run.events(1)
    assert events and events[-1].event == "open" and events[-1].path == str(ckpt / TRACKER), \
        [e.describe() for e in events]  # attempt 1 died there, at its first tracker write
    assert [e.path for e in events].count(str(ckpt / TRACKER)) == 1, [e.describe() for e in events]
    assert str(ckpt / "global_step_4" / "data.pt") in [e.path for e in events], [e.describe() for e in events]
    log = run.log_until_launch(2)
    assert "attempt 2" in log and "from step 4 (" in log, log[-4000:]
    # verl's tracker still said 2 when attempt 1 died after finishing step 4: rlsup rewrote it before launch.
    assert "said '2'" in log and "now points at step 4" in log, log[-4000:]
    assert (ckpt / f"{TRACKER}.rlsup-prev").read_text() == "2"
    # verl's own resume (find_latest_ckpt_path, the repaired tracker) loaded step 4, not 2.
    stdout = run.result.stdout
    assert f"Resuming from {ckpt}/global_step_4" in stdout and "step:5 - " in stdout
    assert incidents(run.workdir / ".rlsup")[1]["resumed_step"] == 4


def test_torn_tracker_is_repaired_before_verl_reads_it(workdir: Path, killed_twice: KilledRun) -> None:
    ckpt = workdir / "ckpt"
    # Steps 2 and 4 of ``killed_twice`` (one rank: the restart below runs one rank too), without its step 6 and
    # tracker backup.
    assert (killed_twice.ckpt / "global_step_4" / "data.pt").exists(), "no step 4 to copy: killed_twice failed"
    shutil.copytree(killed_twice.ckpt, ckpt, ignore=lambda d, names: {"global_step_6", f"{TRACKER}.rlsup-prev"}
                    & set(names) if Path(d) == killed_twice.ckpt else set())
    (ckpt / TRACKER).write_text("")  # open("w") truncated it; the kill came before write()
    assert verl_resume_pick(ckpt) == "raised ValueError"  # verl alone: int(b"") at every restart
    # One attempt, never restarted: no warm launcher for a next one (it would cost a cold start's CPU, unused).
    r = subprocess.run(rlsup_verl(workdir, ckpt, driver_cmd(ckpt, 6, ranks=1), "--warm-launcher", "false"),
                       cwd=workdir, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert_completed(r, ckpt)
    assert "said ''" in r.stderr and "now points at step 4" in r.stderr, r.stderr[-4000:]
    assert (ckpt / f"{TRACKER}.rlsup-prev").read_text() == ""
    assert f"Resuming from {ckpt}/global_step_4" in r.stdout
    assert incidents(workdir / ".rlsup") == []


def test_freeze_is_caught_as_a_hang_from_verl_output(workdir: Path) -> None:
    ckpt = workdir / "ckpt"
    env = clean_env(VERL_DRIVER_FREEZE_AT="4")
    job = driver_cmd(ckpt, 4, "--step-seconds", "0.2")  # step 2 saved, frozen before 4, resumed: 3 and 4 again
    # One restart, the one the freeze needs: attempt 1 then arms no warm launcher for an attempt 2 (3 processes
    # importing torch, never used). Attempt 1 still starts warm, from the launcher armed beside attempt 0.
    cmd = rlsup_verl(workdir, ckpt, job, "--max-restarts", "1")
    # After its last step the driver saves and tears down in silence: 8 s was once too short for that at load 13
    # (a second "hang" after the last step); the freeze is still caught 15 s after step 3.
    cmd[cmd.index("--heartbeat-timeout") + 1] = "15"
    r = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=400)
    assert_completed(r, ckpt, total=4)
    assert "freezing before step 4" in r.stdout
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["reason"] == "hang" and inc["last_step"] == 3, inc
    assert inc["resumed_step"] == 2, inc  # attempt 1 resumed from the step saved before the freeze
    assert inc["stacks"], "no stacks in the hang incident (py-spy missing?)"
    assert any("freeze_here" in s and "verl_driver.py" in s for s in inc["stacks"].values()), inc["stacks"]
    assert f"Resuming from {ckpt}/global_step_2" in r.stdout
