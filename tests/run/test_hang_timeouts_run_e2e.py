"""The learned heartbeat timeout in a real ``rlsup run`` (issue 41, docs/hangs.md): intervals count across
attempts, so a trainer whose attempts each report only two steps has its hang in the third attempt caught
within the learned timeout, not the initial one; and the next ``rlsup run`` of the same command (a requeue)
starts from what was learned. The rules themselves are tested in process: tests/diagnosis/test_hang_detector.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from support.env import JOBS
from support.incidents import incidents
from support.procs import run_rlsup

INITIAL = 60.0  # the initial timeout: the run's subprocess deadline is below it, so a hang held to it fails
RUN = ["run", "--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--max-restarts", "5",
       "--max-no-progress-attempts", "0", "--heartbeat-timeout-initial", str(INITIAL), "--startup-timeout", "60",
       "--auto-timeout-floor", "1", "--auto-timeout-min-intervals", "3", "--",
       sys.executable, str(JOBS / "two_steps_job.py"), "0.3"]


def hang_timeout(inc: dict) -> tuple[float, float]:
    """(silent, timeout) from the incident's 'rank 0 (pid P) silent for 1.62s > heartbeat_timeout 1.55s'."""
    m = re.search(r"silent for ([0-9.]+)s > heartbeat_timeout ([0-9.]+)s", inc["detail"])
    assert m is not None, inc
    return float(m[1]), float(m[2])


def status(workdir: Path) -> dict:
    r = run_rlsup(["status", "--json"], workdir)
    return json.loads(r.stdout)["job"]


def test_a_hang_in_the_third_attempt_is_caught_within_the_timeout_learned_across_attempts(workdir: Path) -> None:
    r = run_rlsup(RUN, workdir, timeout=INITIAL - 10, TWO_STEPS_STOP_AT="2")
    assert r.returncode == 0, r.stderr[-3000:]
    found = incidents(workdir / ".rlsup")
    assert [(i["attempt"], i["reason"]) for i in found] == [(0, "exit_code"), (1, "exit_code"), (2, "hang")], found
    silent, timeout = hang_timeout(found[2])
    assert timeout < 10 <= INITIAL and timeout <= silent < timeout + 5, found[2]["detail"]  # 5 x ~0.3 s, floor 1
    job = status(workdir)  # how it was reached: learned from the three attempts' intervals (and the fourth's)
    assert job["heartbeat_timeout_origin"]["source"] == "learned", job
    assert job["heartbeat_timeout_origin"]["intervals"] >= 3 and job["heartbeat_timeout_s"] < 10, job
    text = run_rlsup(["status"], workdir).stdout
    assert "heartbeat timeout: " in text and "(learned from " in text, text

    # The next rlsup of the same command (a requeue) starts from what was learned: its first attempt's hang
    # is caught at once within it. Without the learned file it would wait the initial 60 s.
    assert (workdir / ".rlsup" / "heartbeat_timeout.json").is_file()
    r = run_rlsup(RUN, workdir, timeout=INITIAL - 10, TWO_STEPS_STOP_AT="0")
    assert r.returncode == 0, r.stderr[-3000:]
    last = incidents(workdir / ".rlsup")[-1]
    assert (last["attempt"], last["reason"]) == (0, "hang"), last
    silent, timeout = hang_timeout(last)
    assert timeout < 10 and silent < timeout + 5, last["detail"]
