"""The verl recipe of issue 20, on CPU: ``rlsup run --checkpoint-layout verl --repair-tracker true
--progress verl -- <trainer>`` around an unmodified trainer that saves and resumes through verl 0.9.1's
own code (``tests/jobs/verl_driver.py``: FSDP on gloo, ``FSDPCheckpointManager``, ``data.pt``, the
tracker, ``find_latest_ckpt_path``, ``LocalLogger``).

* SIGKILL mid-save (kill_matrix's hook, attempt 0 only): killed just before verl writes the tracker for
  step 4, every file of step 4 is on disk but the tracker still says 2, so verl alone would redo steps.
  rlsup picks step 4, rewrites the tracker (old kept as ``.rlsup-prev``), verl's own resume loads 4.
* SIGKILL before ``data.pt``: step 4 is incomplete; rlsup resumes from 2 and leaves the tracker alone.
* A torn tracker (what a kill between ``open("w")`` and ``write`` leaves): verl's own resume raises on
  it at every restart; rlsup repairs it to the newest valid step before launch.
* A freeze: the job stops printing ``step:N - ...``; rlsup calls it a hang with stacks and restarts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kill_matrix
from support.env import JOBS, ROOT, clean_env
from support.incidents import incidents
from support.ports import free_ports
from support.procs import rlsup_cmd

pytest.importorskip("verl.utils.checkpoint.fsdp_checkpoint_manager", reason="verl is not installed")

TRACKER = "latest_checkpointed_iteration.txt"
DRIVER = JOBS / "verl_driver.py"
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "3"]


def driver_cmd(ckpt: Path, total: int, *extra: str, ranks: int = 2) -> list[str]:
    """torchrun on CPU ranks, verl's trainer.* settings as driver flags. The kill runs use one rank: with
    two, which rank makes ``global_step_N/actor`` (verl's local_mkdir_safe under a file lock) is a race, so
    rank 0's event count before a given file would vary from run to run."""
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


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[kill_matrix.FileEvent], Path]:
    """One clean run to step 4 (saves 2 and 4) with rank 0's file events: kill points and a template."""
    ckpt = tmp_path_factory.mktemp("verl-record") / "ckpt"
    ckpt.mkdir()
    events, out = kill_matrix.record_events(driver_cmd(ckpt, 4, ranks=1), ckpt, env=clean_env(), cwd=ROOT,
                                            only_where="RANK", timeout=300)
    assert "step:4 - " in out and (ckpt / TRACKER).read_text() == "4", out[-3000:]
    return events, ckpt


def kill_point(events: list[kill_matrix.FileEvent], suffix: str) -> int:
    """Index (in rank 0's count) of the event that opens ``global_step_4/...suffix`` or the tracker
    write that follows step 4's save."""
    if suffix == TRACKER:
        opens = [e for e in events if e.event == "open" and e.path.endswith(TRACKER)]
        assert len(opens) == 2, [e.describe() for e in events]
        return opens[1].index
    (hit,) = [e for e in events if e.event == "open" and e.path.endswith(f"global_step_4/{suffix}")]
    return hit.index


def killed_run(workdir: Path, ckpt: Path, k: int) -> subprocess.CompletedProcess:
    """The recipe, with attempt 0's rank 0 SIGKILLed just before its k-th file event under ``ckpt``."""
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(kill_matrix._hook_dir())), env["PYTHONPATH"]])
    env[kill_matrix.EVENTS_UNDER] = str(ckpt.resolve())
    env[kill_matrix.ONLY_WHERE] = "RANK"
    env[kill_matrix.EVENTS_LOG] = str(workdir / "events.tsv")
    # Only attempt 0's job may be killed (rlsup itself never counts to k: no kill variable in its env).
    wrapper = ["bash", "-c", f'[ "$RLSUP_RESTART_COUNT" = 0 ] && export {kill_matrix.KILL_AT}={k}; exec "$@"', "_"]
    return subprocess.run(rlsup_verl(workdir, ckpt, [*wrapper, *driver_cmd(ckpt, 6, ranks=1)]), cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=400)


def verl_resume_pick(ckpt: Path) -> str:
    """What verl's own ``find_latest_ckpt_path`` returns (or raises) on this directory. Called here: it only reads
    the tracker, and this module imported verl already (a fresh process to import it again cost 8 s of CPU)."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    try:
        return str(find_latest_ckpt_path(str(ckpt)))
    except Exception as e:  # what verl raises is the answer
        return f"raised {type(e).__name__}"


def assert_completed(r: subprocess.CompletedProcess, ckpt: Path) -> None:
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-4000:])
    assert "training done at step 6" in r.stdout and "step:6 - " in r.stdout
    assert (ckpt / TRACKER).read_text() == "6"


def test_sigkill_before_the_tracker_write_resumes_from_the_complete_step(workdir: Path, recorded) -> None:
    events, _ = recorded
    ckpt = workdir / "ckpt"
    k = kill_point(events, TRACKER)
    r = killed_run(workdir, ckpt, k)
    assert_completed(r, ckpt)
    assert f"{k}\topen\t{ckpt / TRACKER}" in (workdir / "events.tsv").read_text()  # attempt 0 died there
    log = r.stderr
    assert "attempt 1" in log and "from step 4 (" in log, log[-4000:]
    # verl's tracker still said 2 when attempt 0 died after finishing step 4: rlsup rewrote it before launch.
    assert "said '2'" in log and "now points at step 4" in log, log[-4000:]
    assert (ckpt / f"{TRACKER}.rlsup-prev").read_text() == "2"
    # verl's own resume (find_latest_ckpt_path, the repaired tracker) loaded step 4, not 2.
    assert f"Resuming from {ckpt}/global_step_4" in r.stdout and "step:5 - " in r.stdout
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["resumed_step"] == 4, inc


def test_sigkill_before_data_pt_resumes_from_the_previous_step(workdir: Path, recorded) -> None:
    events, _ = recorded
    ckpt = workdir / "ckpt"
    r = killed_run(workdir, ckpt, kill_point(events, "data.pt"))
    assert_completed(r, ckpt)
    assert "from step 2 (" in r.stderr and "now points at" not in r.stderr, r.stderr[-4000:]
    assert f"Resuming from {ckpt}/global_step_2" in r.stdout
    assert not (ckpt / f"{TRACKER}.rlsup-prev").exists()  # the tracker (2) already named the newest valid step


def test_torn_tracker_is_repaired_before_verl_reads_it(workdir: Path, recorded) -> None:
    _, template = recorded
    ckpt = workdir / "ckpt"
    shutil.copytree(template, ckpt)  # steps 2 and 4, one rank: the restart below runs one rank too
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
    job = driver_cmd(ckpt, 6, "--step-seconds", "0.2")
    cmd = rlsup_verl(workdir, ckpt, job)
    # After its last step the driver saves and tears down in silence: 8 s was once too short for that at load 13
    # (a second "hang" after step 6); the freeze is still caught 15 s after step 3.
    cmd[cmd.index("--heartbeat-timeout") + 1] = "15"
    r = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=400)
    assert_completed(r, ckpt)
    assert "freezing before step 4" in r.stdout
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["reason"] == "hang" and inc["last_step"] == 3, inc
    assert inc["resumed_step"] == 2, inc  # attempt 1 resumed from the step saved before the freeze
    assert inc["stacks"], "no stacks in the hang incident (py-spy missing?)"
    assert any("freeze_here" in s and "verl_driver.py" in s for s in inc["stacks"].values()), inc["stacks"]
    assert f"Resuming from {ckpt}/global_step_2" in r.stdout
