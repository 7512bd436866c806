"""GPU-era failures under the real ``rlsup run``, on CPU: jobs that print what real GPU ranks printed
(tests/data/gpu_errors/, recorded on an H200 or from public issues) and exit 1 as those ranks did. A CUDA OOM
is recorded as ``cuda_oom`` and restarted; a printed lost GPU (uncorrectable ECC) that NVML's node check cannot
confirm is ``cuda_error`` and restarted on the node; under torchrun the structured error file is read."""

from __future__ import annotations

import json
from pathlib import Path

from support.env import JOBS, PY
from support.incidents import incidents, read_state
from support.procs import run_rlsup

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu_errors"
JOB = str(JOBS / "gpu_error_job.py")
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--checkpoint-dir", "ckpt"]


def test_printed_cuda_oom_is_cuda_oom_and_restarts(tmp_path: Path) -> None:
    r = run_rlsup(["run", *FAST, "--", PY, JOB, str(DATA / "h200_cuda_oom.out"), "print"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    (inc,) = incidents(tmp_path / ".rlsup")
    assert (inc["reason"], inc["action"], inc["exit_code"]) == ("cuda_oom", "restart", 1), inc
    assert "CUDA out of memory (output): torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 279.60 GiB" \
        in inc["detail"], inc


def test_printed_lost_gpu_unconfirmed_restarts_on_the_node(tmp_path: Path) -> None:
    """A printed uncorrectable ECC error alone does not exclude the node: rlsup's node check (NVML) finds
    nothing wrong here (no GPU, or a healthy one) and no Xid was logged, so it is cuda_error, restarted on
    this node, the detail saying why (exit 77 on a confirmed loss: tests/diagnosis/test_gpu_failures.py)."""
    r = run_rlsup(["run", *FAST, "--", PY, JOB, str(DATA / "cuda_ecc_uncorrectable.out"), "print"], tmp_path,
                  SLURMD_NODENAME="gpu-node-7")
    assert r.returncode == 0, r.stdout + r.stderr
    state_dir = tmp_path / ".rlsup"
    assert not (state_dir / "unhealthy_nodes").exists() or (state_dir / "unhealthy_nodes").read_text() == ""
    (inc,) = incidents(state_dir)
    assert (inc["reason"], inc["action"]) == ("cuda_error", "restart"), inc
    assert "uncorrectable ECC error (output): RuntimeError: CUDA error: uncorrectable ECC error encountered; " \
        "gpu_lost not confirmed (node check: " in inc["detail"], inc
    assert read_state(state_dir)["state"] == "succeeded"
    assert (tmp_path / "ckpt" / "marker").read_text() == "written before the failure\n"


def test_torchrun_error_file_oom(tmp_path: Path) -> None:
    """Under torchrun the worker's ``@record`` exception reaches rlsup's error file (the attempt's
    ``torchelastic_error.json``); rlsup reads the OOM there and in torchrun's Root Cause report."""
    launch = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", JOB,
              str(DATA / "h200_cuda_oom.error.json"), "raise"]
    # --max-restarts 1: the one OOM (attempt 1 arms no warm launcher it would never use)
    r = run_rlsup(["run", *FAST, "--max-restarts", "1", "--", *launch], tmp_path, timeout=240, OMP_NUM_THREADS="1")
    assert r.returncode == 0, r.stdout + r.stderr
    (inc,) = incidents(tmp_path / ".rlsup")
    assert (inc["reason"], inc["action"], inc["rank"]) == ("cuda_oom", "restart", 0), inc
    assert "CUDA out of memory (error file): OutOfMemoryError: CUDA out of memory" in inc["detail"], inc
    report = json.loads((tmp_path / ".rlsup" / "attempts" / "attempt_0000" / "torchelastic_error.json").read_text())
    assert report["message"]["message"].startswith("OutOfMemoryError: CUDA out of memory")
