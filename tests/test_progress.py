"""Progress read from an unmodified trainer's output (issue 20): the presets read each trainer's real
line, and a job that only prints verl-format progress and then freezes is caught as hung within the
learned timeout, with py-spy stacks in the incident, and restarted. Real processes throughout."""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import JOBS, free_ports, incidents, run_rlsup, start_rlsup, wait_for
from rlsup_format.heartbeat_record import read_record
from supervisor.process_tree import OutputTail
from supervisor.progress import JOB_RANK, PRESETS, ProgressRecorder, progress_pattern

PY = sys.executable
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_reads_its_trainers_line(name: str, tmp_path: Path) -> None:
    rec = ProgressRecorder(progress_pattern(name, ""), tmp_path, pid=4242)
    rec.feed(PRESETS[name].example)
    (path,) = tmp_path.glob("rank_*.hb")
    record = read_record(path)
    assert record is not None and (record.rank, record.step, record.pid) == (JOB_RANK, 12, 4242)
    assert record.beat_ns > 0
    for other in set(PRESETS) - {name}:  # no preset reads another trainer's line as progress
        assert not progress_pattern(other, "").search(PRESETS[name].example), (other, name)


def test_a_tqdm_bar_is_read_as_it_redraws(tmp_path: Path) -> None:
    """The HF preset sees each ``\\r`` redraw at once, not only when the bar's line ends."""
    import os
    import threading

    read_fd, write_fd = os.pipe()
    steps: list[int] = []
    seen = threading.Event()

    class Spy(ProgressRecorder):
        def beat(self, step: int) -> None:
            steps.append(step)
            if step == 3:
                seen.set()

    tail = OutputTail(5, tmp_path / "out.log", echo=open(os.devnull, "w"))
    tail.on_segment = Spy(progress_pattern("hf", ""), tmp_path, pid=1).feed
    tail.start(os.fdopen(read_fd, "rb", buffering=0))
    for step in (1, 2, 3):
        os.write(write_fd, f"\r {step * 10}%|█         | {step}/10 [00:0{step}<00:09,  1.00it/s]".encode())
    assert seen.wait(10), steps  # no newline written yet
    os.write(write_fd, b"\n{'loss': 1.5, 'epoch': 0.3}\n")
    os.close(write_fd)
    tail.join(10)
    assert sorted(set(steps)) == [1, 2, 3] and steps == sorted(steps)  # a redraw may be read twice, never lost
    assert tail.tail()[-1] == "{'loss': 1.5, 'epoch': 0.3}"


def test_frozen_unmodified_trainer_is_a_hang_with_stacks(workdir: Path) -> None:
    r = run_rlsup(["run", *FAST, "--progress", "verl", "--auto-timeout-floor", "2", "--auto-timeout-min-intervals",
                   "5", "--", PY, str(JOBS / "verl_format_job.py"), "30", "12"], workdir, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "training done" in r.stdout
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["reason"] == "hang" and inc["rank"] == JOB_RANK and inc["last_step"] == 11, inc
    silent, timeout = _silence(inc["detail"])
    assert timeout == 2.0 and timeout <= silent < timeout + 1.5, inc["detail"]  # the learned timeout (floor)
    (stack,) = inc["stacks"].values()
    assert "wait_for_rollout" in stack and "verl_format_job.py" in stack, inc["stacks"]
    assert inc["resumed_step"] is None  # nothing saved: a fresh start, which the job then finishes


def _silence(detail: str) -> tuple[float, float]:
    """(silent, timeout) from 'rank -1 (pid P) silent for 2.10s > heartbeat_timeout 2.00s'."""
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


def test_presets_are_documented_with_their_source() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "progress.md").read_text()
    for name, preset in PRESETS.items():
        assert f"`{name}`" in doc and preset.source in doc and json.dumps(preset.regex)[1:-1] in doc


def test_verl_line_interleaved_with_another_ranks_write_still_counts(tmp_path: Path) -> None:
    """torchrun's ranks share one pipe: another rank's text can land right before verl's 'step:N'."""
    rec = ProgressRecorder(progress_pattern("verl", ""), tmp_path, pid=1)
    rec.feed("freezing before step 4step:3 - actor/pg_loss:4.1483 - training/global_step:3 - timing_s/step:0.2")
    record = read_record(next(tmp_path.glob("rank_*.hb")))
    assert record is not None and record.step == 3


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
    assert all(i["last_step"] == 3 and i["rank"] == JOB_RANK for i in inc), inc


def test_areal_done_line_is_its_last_step_only() -> None:
    done = re.compile(PRESETS["areal"].done)
    line = "20251124-08:41:03.123 StatsLogger INFO: Epoch 3/3 Step 200/200 Train step {}/600 done."
    assert done.search(line.format(600)) and not done.search(line.format(60))
    assert not done.search(line.format(599)) and not done.search(line.format(6))
    assert all(not p.done for name, p in PRESETS.items() if name != "areal")  # they exit 0 when done


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


def test_metrics_follow_the_ranks_once_they_beat_beside_the_output() -> None:
    """The output's record is ``local_rank="job"`` while it alone beats; once ranks beat, their records
    count: the saves of rank 0 are counted (the output's record never saves) and the "job" series goes."""
    import time

    from rlsup_format.heartbeat_record import HeartbeatRecord
    from supervisor.metrics import SupervisorMetrics

    m = SupervisorMetrics("job")
    now = time.monotonic_ns()
    job = HeartbeatRecord(JOB_RANK, 10, 3, now, "none", 0, False)
    m.heartbeats({JOB_RANK: job}, 30.0)
    assert m.registry.get_sample_value("rlsup_heartbeat_age_seconds", {"local_rank": "job"}) is not None
    assert m.registry.get_sample_value("rlsup_heartbeat_age_seconds", {"local_rank": "-1"}) is None
    ranks = {r: HeartbeatRecord(r, 20 + r, 4, now, "none", 0, False, saves=2, save_ns=10**8) for r in (0, 1)}
    m.heartbeats({JOB_RANK: job, **ranks}, 30.0)
    assert m.registry.get_sample_value("rlsup_checkpoint_saves_total") == 2
    assert m.registry.get_sample_value("rlsup_heartbeat_age_seconds", {"local_rank": "job"}) is None
    assert m.registry.get_sample_value("rlsup_heartbeat_age_seconds", {"local_rank": "0"}) is not None
    assert m.registry.get_sample_value("rlsup_last_step") == 4
