"""The end-to-end half of test_progress.py (real processes, or waits on real time): progress read from an
unmodified trainer's output (issue 20): the presets read each trainer's real line, and a job that only prints
verl-format progress and then freezes is caught as hung within the learned timeout, with py-spy stacks in the
incident, and restarted."""

from __future__ import annotations


import json
import sys
import urllib.request
from pathlib import Path

import pytest

from support.env import JOBS
from support.incidents import incidents
from support.ports import free_ports
from support.procs import run_rlsup, start_rlsup
from support.waits import wait_for

PY = sys.executable
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2"]


def test_frozen_unmodified_trainer_is_a_hang_with_stacks(workdir: Path) -> None:
    r = run_rlsup(["run", *FAST, "--progress", "verl", "--auto-timeout-floor", "2", "--auto-timeout-min-intervals",
                   "5", "--", PY, str(JOBS / "verl_format_job.py"), "30", "12"], workdir, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "training done" in r.stdout
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["reason"] == "hang" and inc["rank"] == 0 and inc["last_step"] == 11, inc  # the job's only process
    silent, timeout = _silence(inc["detail"])
    assert timeout == 2.0 and timeout <= silent < timeout + 1.5, inc["detail"]  # the learned timeout (floor)
    (stack,) = inc["stacks"].values()
    assert "wait_for_rollout" in stack and "verl_format_job.py" in stack, inc["stacks"]
    assert inc["resumed_step"] is None  # nothing saved: a fresh start, which the job then finishes


def _silence(detail: str) -> tuple[float, float]:
    """(silent, timeout) from "the job's output silent for 2.10s > heartbeat_timeout 2.00s; stuck: ..."."""
    silent = float(detail.split("silent for ")[1].split("s")[0])
    timeout = float(detail.split("heartbeat_timeout ")[1].split("s")[0])
    return silent, timeout


def test_rank_heartbeats_take_precedence_over_output(workdir: Path) -> None:
    """A job that heartbeats through trainer_hooks and prints matching lines rarely is judged by its ranks."""
    script = workdir / "both.py"
    script.write_text("import time, trainer_hooks\n"
                      "for step in range(1, 31):\n"
                      "    trainer_hooks.heartbeat(step)\n"
                      "    time.sleep(0.1)\n"
                      "    if step == 2:\n"
                      "        print('step:2 - loss:1.0', flush=True)\n")
    r = run_rlsup(["run", *FAST, "--progress", "verl", "--heartbeat-timeout", "1.5", "--", PY, str(script)], workdir)
    assert r.returncode == 0 and incidents(workdir / ".rlsup") == [], r.stderr[-2000:]


@pytest.mark.parametrize("flags, key", [(["--progress", "ray"], "progress"),
                                        (["--progress-regex", "step (\\d+"], "progress_regex"),
                                        (["--progress-regex", "step \\d+"], "progress_regex")])
def test_bad_progress_config_is_refused(workdir: Path, flags: list[str], key: str) -> None:
    r = run_rlsup(["run", *flags, "--", PY, "-c", "0"], workdir)
    assert r.returncode == 2 and f"key '{key}'" in r.stderr, r.stderr
    assert not (workdir / ".rlsup" / "incidents.jsonl").exists()


def test_unmodified_trainers_step_reaches_metrics_and_status(workdir: Path) -> None:
    """``rlsup_last_step`` and ``rlsup status`` follow the output's steps while the job runs."""
    (port,) = free_ports(1)
    proc = start_rlsup(["run", *FAST, "--progress", "verl", "--", PY, str(JOBS / "verl_format_job.py"), "600", "0"],
                       workdir, RLSUP_METRICS_PORT=str(port))
    try:
        def metric_step() -> float | None:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            except OSError:
                return None
            got = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("rlsup_last_step")]
            return got[0] if got and got[0] >= 5 else None

        seen = wait_for(metric_step, 90, "rlsup_last_step >= 5 from the job's output")
        status = json.loads(run_rlsup(["status", "--json"], workdir).stdout)
        assert status["job"]["state"] == "running" and status["job"]["last_step"] >= seen, status["job"]
        text = run_rlsup(["status"], workdir).stdout  # the job keeps stepping: a step at least as new
        assert int(text.split("last step: ")[1].split()[0]) >= status["job"]["last_step"], text
    finally:
        proc.terminate()
        proc.wait(60)


def test_no_progress_guard_stops_an_unmodified_trainer_that_hangs_at_the_same_point(workdir: Path) -> None:
    """Every attempt prints verl's steps, then freezes before saving anything: hangs, then the guard."""
    script = workdir / "stuck_verl.py"
    script.write_text("import time\n"
                      "for step in range(1, 4):\n"
                      "    print(f'step:{step} - actor/pg_loss:0.1', flush=True)\n"
                      "    time.sleep(0.1)\n"
                      "while True:\n"
                      "    time.sleep(1)\n")
    r = run_rlsup(["run", *FAST, "--progress", "verl", "--heartbeat-timeout", "2", "--max-restarts", "10",
                   "--max-no-progress-attempts", "2", "--", PY, str(script)], workdir, timeout=180)
    assert r.returncode == 76, r.stderr[-3000:]
    inc = incidents(workdir / ".rlsup")
    assert [i["reason"] for i in inc] == ["hang"] * len(inc) and inc[-1]["action"] == "no_progress", inc
    assert all(i["last_step"] == 3 and i["rank"] == 0 for i in inc), inc  # the stuck process, not the output's -1


def test_a_launcher_that_exits_1_after_the_last_step_is_not_restarted(workdir: Path) -> None:
    """AReaL's launchers exit 1 even when training completed: under the areal preset an exit after the
    last step's line ends the job as succeeded; an exit after any other step is a failure, restarted."""
    script = workdir / "areal_like.py"
    script.write_text("import os, sys, time\n"
                      "attempt = int(os.environ['RLSUP_RESTART_COUNT'])\n"
                      "last = 3 if attempt == 0 else 6  # attempt 0 fails half-way\n"
                      "for step in range(1, last + 1):\n"
                      "    print(f'(AReaL) 20251124-08:41:03.123 StatsLogger INFO: Epoch 1/1 Step {step}/6 '\n"
                      "          f'Train step {step}/6 done.', flush=True)\n"
                      "    time.sleep(0.05)\n"
                      "sys.exit(1)  # JobException(COMPLETED) or a real failure: the same exit code\n")
    r = run_rlsup(["run", *FAST, "--progress", "areal", "--", PY, str(script)], workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    (inc,) = incidents(workdir / ".rlsup")  # attempt 0 only
    assert inc["reason"] == "exit_code" and inc["last_step"] == 3 and inc["action"] == "restart", inc
    assert "succeeded after 2 attempt(s); exit 0 (exit code 1 after the trainer said it finished" in r.stderr
    assert "Train step 6/6 done." in r.stderr
    state = json.loads(run_rlsup(["status", "--json"], workdir).stdout)["job"]
    assert state["state"] == "succeeded" and state["exit_code"] == 1  # the real exit code is kept


def test_a_bar_redrawn_at_a_stuck_step_is_caught_as_a_hang(workdir: Path) -> None:
    """Real processes: a trainer's bar reaches step 3 and then is only redrawn (tqdm's elapsed time
    moving, as when a rank hangs inside a step): hung within the timeout of step 3's beat, last step 3."""
    script = workdir / "stuck_bar.py"
    script.write_text("import sys, time\n"
                      "for s in range(1, 4):\n"
                      "    sys.stderr.write(f'\\r {s * 10}%|█         | {s}/10 [00:0{s}<00:09,  1.00it/s]')\n"
                      "    sys.stderr.flush()\n"
                      "    time.sleep(0.2)\n"
                      "t = 3.0\n"
                      "while True:\n"
                      "    t += 0.2\n"
                      "    sys.stderr.write(f'\\r 30%|███       | 3/10 [00:{int(t):02d}<00:07,  1.00it/s]')\n"
                      "    sys.stderr.flush()\n"
                      "    time.sleep(0.2)\n")
    r = run_rlsup(["run", *FAST, "--progress", "hf", "--heartbeat-timeout", "2", "--max-restarts", "0", "--",
                   PY, str(script)], workdir, timeout=120)
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["reason"] == "hang" and inc["rank"] == 0 and inc["last_step"] == 3, (inc, r.stderr[-2000:])
    silent, timeout = _silence(inc["detail"])
    assert timeout == 2.0 and timeout <= silent < timeout + 1.5, inc["detail"]


def test_progress_from_output_runs_the_job_unbuffered_unless_the_user_chose(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """print() into a pipe is block-buffered: nanoGPT's lines would arrive in 8 KB bursts."""
    from support.fake_run_loop import Attempt, make

    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    for progress, user, want in (("nanogpt", None, "1"), ("", None, None), ("nanogpt", "0", "0")):
        if user is not None:
            monkeypatch.setenv("PYTHONUNBUFFERED", user)
        sup, layer, _ = make(tmp_path / f"{progress}{user}", Attempt(exit_code=0), progress=progress)
        sup.run()
        assert layer.jobs[0].env.get("PYTHONUNBUFFERED") == want

