"""`rlsup run` where only real processes show it: stacks of a hung rank, orphaned grandchildren, real stop
and preemption signals reaching the ranks' handlers, real torchrun, rlsup itself SIGKILLed, save sections.

The run loop's decisions (crash and resume, give-up, fatal codes, signal deaths, startup timeout, no
progress) are tested in process over the fake process layer: tests/run/test_run_loop.py."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from support.env import JOBS
from support.incidents import incidents
from support.procs import pid_alive, run_rlsup, start_rlsup
from support.waits import wait_for

PY = sys.executable
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2"]


def test_hang_detected_with_stacks(workdir: Path) -> None:
    timeout = 1.5
    r = run_rlsup(["run", *FAST, "--heartbeat-timeout", str(timeout), "--", PY, str(JOBS / "hang_job.py")], workdir)
    assert r.returncode == 0, r.stderr
    inc = incidents(workdir / ".rlsup")
    assert len(inc) == 1 and inc[0]["reason"] == "hang", inc
    assert inc[0]["rank"] == 0 and inc[0]["last_step"] == 5
    silent = float(inc[0]["detail"].split("silent for ")[1].split("s")[0])
    assert timeout <= silent < timeout + 1.0  # caught within the timeout plus the poll margin
    (stack,) = inc[0]["stacks"].values()
    assert "stuck_in_collective" in stack and "hang_job.py" in stack


def test_grandchild_of_failed_attempt_is_killed(workdir: Path) -> None:
    pidfile = workdir / "grandchild.pid"
    r = run_rlsup(["run", *FAST, "--", PY, str(JOBS / "grandchild_job.py"), str(pidfile)], workdir)
    assert "alive=False" in r.stdout, r.stdout + r.stderr
    assert r.returncode == 0
    assert not pid_alive(int(pidfile.read_text()))


def test_sigterm_reaches_job_and_rlsup_exits(workdir: Path) -> None:
    marker = workdir / "saved.txt"
    proc = start_rlsup(["run", *FAST, "--", PY, str(JOBS / "stop_job.py"), str(marker)], workdir)
    hb_dir = workdir / ".rlsup" / "attempts" / "attempt_0000" / "heartbeats"
    wait_for(lambda: list(hb_dir.glob("rank_*.hb")), 30, "the job's first heartbeat")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert marker.read_text().startswith("saved at step")
    inc = incidents(workdir / ".rlsup")
    assert inc[-1]["reason"] == "stopped" and inc[-1]["action"] == "stop"


def test_preemption_signal_relayed_and_exit_for_requeue(workdir: Path) -> None:
    marker = workdir / "saved.txt"
    proc = start_rlsup(["run", *FAST, "--", PY, str(JOBS / "stop_job.py"), str(marker)], workdir)
    hb_dir = workdir / ".rlsup" / "attempts" / "attempt_0000" / "heartbeats"
    wait_for(lambda: list(hb_dir.glob("rank_*.hb")), 30, "the job's first heartbeat")
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out
    assert marker.exists()
    assert incidents(workdir / ".rlsup")[-1]["reason"] == "preempted"


def test_rank_death_seen_by_rlsup_without_waiting_for_torchrun(workdir: Path) -> None:
    """torchrun's agent checks its workers every 5 s here: only rlsup's own watch on the ranks (pidfds,
    the zombie's exit status) can end the attempt at once, kill it with SIGKILL and restart without delay."""
    out = workdir / "result"
    # --max-restarts 1: the one kill (attempt 1 arms no warm launcher it would never use)
    r = run_rlsup(["run", "--kill-grace", "30", "--heartbeat-timeout", "60", "--max-restarts", "1", "--", PY, "-m",
                   "torch.distributed.run", "--standalone", "--monitor-interval", "5", "--nproc-per-node", "2",
                   str(JOBS / "ddp_kill_job.py"), str(out)], workdir, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (inc,) = incidents(workdir / ".rlsup")
    assert (inc["reason"], inc["signal"], inc["rank"]) == ("signal", "SIGKILL", 1), inc
    assert "without waiting for the launcher" in inc["detail"], inc
    assert inc["downtime_s"] < 20, inc  # no 30 s kill_grace, no backoff
    assert "restarting in 0.0s" in r.stderr
    # The whole job restarted: both ranks finished in attempt 1, neither in attempt 0.
    assert sorted(p.name for p in workdir.glob("result.rank*")) == ["result.rank0.attempt1", "result.rank1.attempt1"]
    assert (workdir / "result.rank0.attempt1").read_text() == "2046.0"


def test_lying_verl_tracker_is_repaired_before_restart(workdir: Path) -> None:
    from layout_builders import verl_fsdp_step, write_tracker

    ckpt = workdir / "ckpt"
    verl_fsdp_step(ckpt, 10)
    s20 = verl_fsdp_step(ckpt, 20)
    next(s20.glob("actor/model_world_size_2_rank_1.pt")).unlink()  # step 20 killed mid-save
    write_tracker(ckpt, 20)  # ...but the tracker already says 20
    script = workdir / "read_tracker.py"
    script.write_text("import os\nprint('tracker says', open(os.environ['RLSUP_CHECKPOINT_DIR'] + "
                      "'/latest_checkpointed_iteration.txt').read().strip(), os.environ.get('RLSUP_RESUME_STEP'))\n")
    r = run_rlsup(["run", *FAST, "--checkpoint-dir", str(ckpt), "--repair-tracker", "true", "--", PY, str(script)],
                  workdir)
    assert r.returncode == 0, r.stderr
    assert "tracker says 10 10" in r.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt.rlsup-prev").read_text().strip() == "20"


def test_rlsup_sigkilled_takes_job_with_it_and_next_rlsup_continues(workdir: Path) -> None:
    marker = workdir / "saved.txt"
    proc = start_rlsup(["run", *FAST, "--", PY, str(JOBS / "stop_job.py"), str(marker)], workdir)
    hb_dir = workdir / ".rlsup" / "attempts" / "attempt_0000" / "heartbeats"
    wait_for(lambda: list(hb_dir.glob("rank_*.hb")), 30, "the job's first heartbeat")
    from trainer_hooks.heartbeat import read_record

    job_pid = wait_for(lambda: (r := read_record(next(hb_dir.glob("rank_*.hb")))) and r.pid, 10, "the rank's pid")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    wait_for(lambda: not pid_alive(job_pid), 10, "the job to die with its supervisor")
    # A new rlsup in the same state dir records the loss and continues the attempt numbering.
    r = run_rlsup(["run", *FAST, "--", PY, str(JOBS / "exit_codes_job.py"), "0"], workdir)
    assert r.returncode == 0, r.stderr
    assert "attempt 1 restart_count=1" in r.stdout
    inc = incidents(workdir / ".rlsup")
    assert inc[-1]["reason"] == "supervisor_lost" and inc[-1]["attempt"] == 0


def test_slow_save_is_not_a_hang(workdir: Path) -> None:
    # The save takes twice the heartbeat timeout; the timeout leaves room for a loaded machine.
    r = run_rlsup(["run", *FAST, "--heartbeat-timeout", "3", "--save-timeout", "60", "--",
                   PY, str(JOBS / "slow_save_job.py"), "6"], workdir)
    assert r.returncode == 0, r.stderr
    assert incidents(workdir / ".rlsup") == []


def test_save_beyond_save_timeout_is_a_hang(workdir: Path) -> None:
    r = run_rlsup(["run", *FAST, "--heartbeat-timeout", "30", "--save-timeout", "1", "--",
                   PY, str(JOBS / "slow_save_job.py"), "600"], workdir)
    assert r.returncode == 0, r.stderr
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["reason"] == "save_timeout" and inc["last_step"] == 3


def test_status_reports_state_and_incidents(workdir: Path) -> None:
    """A real crash then success (each attempt's restart count reaches the job, its real output is the
    incident's tail), read back by ``rlsup status``."""
    r = run_rlsup(["run", *FAST, "--", PY, str(JOBS / "exit_codes_job.py"), "3,0"], workdir)
    assert r.returncode == 0, r.stderr
    assert "attempt 0 restart_count=0" in r.stdout and "attempt 1 restart_count=1" in r.stdout
    (inc,) = incidents(workdir / ".rlsup")
    assert (inc["reason"], inc["exit_code"], inc["action"]) == ("exit_code", 3, "restart")
    assert inc["downtime_s"] is not None and inc["output_tail"] == [
        f"attempt 0 restart_count=0 ckpt={workdir / 'checkpoints'}"]
    import json

    status = json.loads(run_rlsup(["status", "--json"], workdir).stdout)
    assert status["job"]["state"] == "succeeded" and status["job"]["attempt"] == 1
    assert [i["reason"] for i in status["incidents"]] == ["exit_code"]
    text = run_rlsup(["status"], workdir).stdout
    assert "job:       succeeded (attempt 1" in text and "attempt 0: exit_code exit code 3 -> restart" in text


def test_a_job_never_resumes_from_another_jobs_steps_in_its_directory(workdir: Path) -> None:
    """Two jobs (job_name a, then b) pointed at one checkpoint_dir: b starts fresh and, at its first save
    over a's step, fails naming both jobs (a's valid step is never overwritten, b's is never silently
    dropped); a, run again, resumes its own last step."""
    import sys

    from support.env import ROOT

    train = [sys.executable, str(ROOT / "examples" / "train_tiny.py"), "--steps", "6", "--checkpoint-every", "3",
             "--step-time", "0", "--keep-last", "100"]

    def run(name: str) -> str:
        out = run_rlsup(["run", "--job-name", name, "--metrics-port", "0", "--max-restarts", "0", "--", *train],
                        workdir)
        return f"{out.returncode}\n{out.stdout}{out.stderr}"

    first = run("a")
    assert first.startswith("0\n") and "starting at step 0" in first, first[-3000:]
    other = run("b")
    assert not other.startswith("0\n") and "starting at step 0" in other, other[-3000:]
    assert "was written by job 'a', this is job 'b'" in other, other[-3000:]
    again = run("a")
    assert again.startswith("0\n") and "starting at step 6" in again, again[-3000:]
