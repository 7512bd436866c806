"""A preemption that arrives while rlsup handles a hang (Flight Recorder dumps, stacks, torch's analyser) is
acted on: the hung job is killed before the analysis is awaited, that wait ends at the stop, and rlsup exits
for requeue instead of holding SLURM's grace past its end. rlsup, torchrun and four gloo ranks as real
processes (tests/jobs/fr_skip_job.py: rank 2 skips an all-reduce)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from support.env import JOBS
from support.incidents import incidents
from support.procs import pid_alive, start_rlsup
from support.waits import wait_for

from rlsup_format.heartbeat_record import rank_file_name, read_record
from supervisor import exit_codes

PY = sys.executable
# rlsup's default launch: attempt 0's 4 ranks forked from one torch import (a cold torchrun's import it each)
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2"]
JOB = ["--heartbeat-timeout", "4", "--", PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
       str(JOBS / "fr_skip_job.py")]


def test_a_preemption_during_the_hang_path_exits_for_requeue_with_the_job_gone(workdir: Path) -> None:
    proc = start_rlsup(["run", *FAST, *JOB], workdir)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("hang detected" in line for line in lines), 180, "rlsup to detect the hang")
        hb = workdir / ".rlsup" / "attempts" / "attempt_0000" / "heartbeats"
        pids = [rec.pid for r in range(4) if (rec := read_record(hb / rank_file_name(r))) is not None]
        assert len(pids) == 4, pids
        proc.send_signal(signal.SIGUSR1)  # SLURM's preemption warning (preempt_signal's default)
        code = wait_for(lambda: proc.poll() is not None and (proc.returncode,), 120, "rlsup to exit")[0]
        reader.join(timeout=10)
        out = "".join(lines)
        assert code == exit_codes.REQUEUE, out[-4000:]
        wait_for(lambda: not any(pid_alive(p) for p in pids), 30, f"the hung ranks {pids} gone")
        assert not (workdir / ".rlsup" / "attempts" / "attempt_0001").exists(), out[-4000:]  # no restart
        (inc,) = incidents(workdir / ".rlsup")
        assert inc["reason"] == "hang" and len(inc["stacks"]) == 4, inc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
