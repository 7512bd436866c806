"""``pre_launch_check: builtin`` (issue 30): rlsup's own NVML check of this node's GPUs before every attempt.

NVML cannot run here (no GPU), so the decision is fed NVML-like answers through a reader object passed in
(:class:`FakeNvml`, the same questions :class:`supervisor.diagnosis.gpu_health.PynvmlReader` asks pynvml); the
real reader runs on a GPU machine (tests/gpu/test_gpu.py). ``rlsup run`` with the builtin check runs
for real: on this CPU node it says "no GPUs: skipped" and the job runs to its end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.procs import run_rlsup

from supervisor import exit_codes
from supervisor.diagnosis.gpu_health import gpu_device_files
from supervisor.run.node_health import BUILTIN
from supervisor.lifecycle import EndReason

PY = sys.executable
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2"]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_rlsup_run_with_the_builtin_check_says_no_gpus_and_runs_the_job(tmp_path: Path, how: str) -> None:
    flag = ["--pre-launch-check", BUILTIN] if how == "flag" else []
    env = {"RLSUP_PRE_LAUNCH_CHECK": BUILTIN} if how == "env" else {}
    done = tmp_path / "done"
    r = run_rlsup(["run", *FAST, *flag, "--", PY, "-c", f"open({str(done)!r}, 'w').write('ran')"], tmp_path, **env)
    assert r.returncode == exit_codes.OK, r.stderr
    assert done.read_text() == "ran"
    said = "no GPUs: skipped" if not gpu_device_files() else "GPU(s) healthy"
    assert f"attempt 0: pre_launch_check builtin: {said}" in r.stderr, r.stderr
    assert EndReason.UNHEALTHY.value not in r.stderr
