"""Naming the rank behind a hung collective from PyTorch's Flight Recorder (issue 30), end to end: rlsup,
torchrun and four gloo ranks as real processes. Rank 2 skips one all-reduce (tests/jobs/fr_skip_job.py),
so every rank's stack is in ``all_reduce`` and the grouped stacks name nobody; FR names rank 2 and the
collective (group, sequence number, op)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.env import JOBS
from support.incidents import incidents
from support.procs import run_rlsup

from rlsup_format.heartbeat_record import fr_dump_name
from supervisor.diagnosis.flight_recorder import ANALYSIS_FILE
from supervisor.membership import node_name

PY = sys.executable
# rlsup's default launch: attempt 0's 4 ranks forked from one torch import (a cold torchrun's import it each);
# --max-restarts 1: each run fails once (one incident, asserted), so its last attempt arms no launcher it never uses
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--max-restarts", "1"]
# The timeout only decides when the stuck attempt is ended; 4 s of silence leaves the healthy steps (0.05 s
# apart) room on a loaded machine.
JOB = ["--heartbeat-timeout", "4", "--", PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
       str(JOBS / "fr_skip_job.py")]
STACKS_VERDICT = "ranks 0-3 are in `all_reduce` (distributed_c10d.py:"


def test_flight_recorder_names_the_rank_that_skipped_a_collective(workdir: Path) -> None:
    r = run_rlsup(["run", *FAST, *JOB], workdir, timeout=240)
    assert r.returncode == 0, r.stderr[-4000:]
    (inc,) = incidents(workdir / ".rlsup")
    node = node_name()
    expected = ("flight recorder: ranks 0, 1, 3 wait in all_reduce #4 (process group 0 default_pg, size 4); rank 2 "
                "last completed #3 and never called #4 (it waits in all_reduce #4 of process group 1 metrics): "
                f"suspect rank 2 on node {node}")
    assert inc["reason"] == "hang" and inc["fr_verdict"] == expected, inc
    assert inc["suspect_ranks"] == [2] and inc["suspect_nodes"] == [node], inc
    # The same hang's grouped stacks alone: one group, no suspect.
    assert inc["verdict"].startswith(STACKS_VERDICT) and "suspect" not in inc["verdict"], inc["verdict"]
    assert len(inc["stacks"]) == 4
    # The log leads with FR's verdict, then the stacks'.
    fr_at, stacks_at = r.stderr.find(expected), r.stderr.find(STACKS_VERDICT)
    assert 0 <= fr_at < stacks_at, r.stderr[-4000:]
    attempt = workdir / ".rlsup" / "attempts" / "attempt_0000"
    assert all((attempt / "heartbeats" / fr_dump_name(rank)).is_file() for rank in range(4))
    analysis = (attempt / ANALYSIS_FILE).read_text()
    assert analysis.startswith(expected) and "missing ranks: {2}" in analysis, analysis  # torch's own report

    status = subprocess.run([PY, "-m", "supervisor.cli.main", "status"], cwd=workdir, capture_output=True, text=True,
                            timeout=60)
    assert expected in status.stdout, status.stdout
    triage = subprocess.run([PY, "-m", "supervisor.cli.main", "incidents", str(workdir / ".rlsup")], capture_output=True,
                            text=True, timeout=60)
    assert expected in triage.stdout and f"suspect nodes: {node} (1x)" in triage.stdout, triage.stdout


def test_with_the_recorder_off_only_the_stacks_speak_and_name_nobody(workdir: Path) -> None:
    """``TORCH_FR_BUFFER_SIZE=0`` (the user's opt-out) stands: no FR thread, no FR verdict, and the stacks of
    the same hang name no suspect."""
    r = run_rlsup(["run", *FAST, *JOB], workdir, timeout=240, TORCH_FR_BUFFER_SIZE="0")
    assert r.returncode == 0, r.stderr[-4000:]
    (inc,) = incidents(workdir / ".rlsup")
    assert inc["reason"] == "hang" and inc["fr_verdict"] == "", inc
    assert inc["verdict"].startswith(STACKS_VERDICT) and inc["suspect_ranks"] == [], inc["verdict"]
    hb = workdir / ".rlsup" / "attempts" / "attempt_0000" / "heartbeats"
    assert not list(hb.glob("*.frreq")) and not list(hb.glob("*.fr.json"))
