"""The end-to-end half of test_logging.py (real processes, or waits on real time): one logging channel: every
component's lines reach rlsup's stderr with one prefix, at --log-level."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.env import clean_env
from support.procs import rlsup_cmd, run_rlsup

from supervisor import log as rlsup_log

JOB = """
import torch
from trainer_hooks import CheckpointManager, heartbeat
ckpt = CheckpointManager()  # RLSUP_CHECKPOINT_DIR
heartbeat(1)
ckpt.save(1, {"w": torch.zeros(4)})
ckpt.wait()
"""


def test_persistent_tier_line_reaches_rlsup_stderr(tmp_path: Path) -> None:
    """A real run with persistent_dir: the tier's own log line is on stderr, and --log-level hides it."""
    (tmp_path / "job.py").write_text(JOB)
    args = ["run", "--persistent-dir", str(tmp_path / "persistent"), "--", sys.executable, str(tmp_path / "job.py")]
    r = run_rlsup(args, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "persistent tier" in line]
    assert lines and all(rlsup_log.LINE.match(line) for line in lines), r.stderr
    quiet = run_rlsup(["--log-level", "WARNING", *args[:1], "--state-dir", ".q", "--checkpoint-dir", "q",
                       *args[1:]], tmp_path)
    assert quiet.returncode == 0 and "persistent tier" not in quiet.stderr and "[rlsup] attempt" not in quiet.stderr, \
        quiet.stderr


HALF_LINES_JOB = """
import os, sys, time
import torch
from pathlib import Path
from trainer_hooks import CheckpointManager

shared = Path(os.environ["SHARED_OUTPUT"])
ckpt = CheckpointManager()  # RLSUP_CHECKPOINT_DIR; rlsup copies each step to the persistent tier, and says so


def when_rlsup_has_said(text):
    deadline = time.monotonic() + 60
    while text not in shared.read_text(errors="replace"):
        if time.monotonic() > deadline:
            print(f"rlsup never said {text!r}", flush=True)
            sys.exit(3)
        time.sleep(0.05)


print("saved 5", end="")  # the text now (PYTHONUNBUFFERED=1) ...
ckpt.save(1, {"w": torch.zeros(4)})
ckpt.wait()
when_rlsup_has_said("step 1 rank 0 copied to the persistent tier")
print()  # ... and its newline after rlsup has logged
print("\\r 50%|#####     | 1/2", end="\\r")  # a progress bar's redraw, left open
ckpt.save(2, {"w": torch.ones(4)})
ckpt.wait()
when_rlsup_has_said("step 2 rank 0 copied to the persistent tier")
print("\\r100%|##########| 2/2")
print("done")
"""


def test_rlsup_logging_between_the_jobs_text_and_newline_never_cuts_a_line(tmp_path: Path) -> None:
    """Issue 41: with PYTHONUNBUFFERED=1 ``print`` writes the text and the newline apart; rlsup logs in between,
    its stdout and stderr one file as under SLURM. Every line of that file is rlsup's or the job's, whole."""
    (tmp_path / "job.py").write_text(HALF_LINES_JOB)
    shared = tmp_path / "slurm-1.out"
    args = ["run", "--persistent-dir", str(tmp_path / "persistent"), "--", sys.executable, str(tmp_path / "job.py")]
    with open(shared, "wb") as out:  # one open file for both streams, as SLURM's output file
        done = subprocess.run(rlsup_cmd(*args), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, timeout=180,
                              env=clean_env(PYTHONUNBUFFERED="1", SHARED_OUTPUT=str(shared)))
    text = shared.read_bytes().decode()
    assert done.returncode == 0, text
    lines = text.split("\n")
    assert lines.pop() == "", text  # the file ends with a whole line
    said = [i for i, line in enumerate(lines) if rlsup_log.parse(line) is not None]
    job = [line for i, line in enumerate(lines) if i not in said]
    assert job == ["saved 5", "\r 50%|#####     | 1/2\r", "\r100%|##########| 2/2", "done"], text
    assert all("[rlsup]" not in line for line in job), text
    copied = {step: next(i for i in said if f"step {step} rank 0 copied" in lines[i]) for step in (1, 2)}
    assert copied[1] < lines.index("saved 5") < copied[2] < lines.index("\r100%|##########| 2/2"), text
