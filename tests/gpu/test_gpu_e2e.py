"""rlsup on a real GPU: exact resume of a CUDA job (sync and pinned async saves), a rank stuck in a CUDA
kernel caught as a hang with its stacks, a real CUDA out-of-memory error recorded, and the restart time of
a CUDA job with and without the warm launcher and with and without CUDA-warm ranks (figures, written for
BENCHMARKS.md, never asserted), and ``pre_launch_check: builtin`` (NVML) passing on this node, timed.

Skipped, with the reason, where CUDA is absent. How to run them on a GPU machine: tests/gpu/README.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.env import ROOT, clean_env
from support.incidents import incidents
from support.procs import rlsup_cmd
from support.waits import wait_for

TRAINER = Path(__file__).resolve().parent / "train_cuda.py"
PY = sys.executable
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "5"]
# Where the figures go (tests/gpu/README.md): the device run copies this file into BENCHMARKS.md's GPU table.
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: tests/gpu/README.md says how to run these on a GPU machine")
REPORT = Path(os.environ.get("RLSUP_GPU_REPORT", ROOT / "gpu-report.jsonl"))


def _report(record: dict) -> None:
    record = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__, **record}
    print(json.dumps(record), flush=True)
    with REPORT.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _rlsup(work: Path, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(rlsup_cmd("run", *FAST, *args), cwd=work, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)


def _reference(work: Path, extra: list[str]) -> dict:
    """An uninterrupted run without rlsup: the weights every resumed run must end with."""
    out = work / "reference.pt"
    r = subprocess.run([PY, str(TRAINER), "--checkpoint-dir", str(work / "ref-ckpt"), "--out", str(out), *extra],
                       cwd=work, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return torch.load(out, weights_only=True)


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after the resume"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("save", ["sync", "async"])
def test_cuda_job_killed_mid_run_resumes_bit_identical(tmp_path: Path, save: str) -> None:
    """SIGKILL after step 13 (its step-10 checkpoint written; async: possibly still copying from pinned
    memory), resume from step 10 on the GPU, end equal to the uninterrupted run, deterministic kernels."""
    extra = ["--steps", "30"] + (["--async-save"] if save == "async" else [])
    ref = _reference(tmp_path, extra)
    out = tmp_path / "final.pt"
    r = _rlsup(tmp_path, ["--checkpoint-dir", "ckpt", "--", PY, str(TRAINER), "--out", str(out),
                          "--crash-at-step", "13", *extra])
    assert r.returncode == 0, r.stdout + r.stderr
    (inc,) = incidents(tmp_path / ".rlsup")
    assert inc["reason"] == "signal" and inc["signal"] == "SIGKILL", inc
    # sync: step 10's save is complete when save() returns; async: it may still be in flight at the kill
    # (three GPU steps take milliseconds), and then the resume is from step 5, the newest complete one
    assert inc["resumed_step"] == 10 or (save == "async" and inc["resumed_step"] == 5), inc
    _assert_equal(torch.load(out, weights_only=True), ref)


@pytest.mark.timeout(600)
def test_torchrun_nccl_rank_killed_resumes_bit_identical(tmp_path: Path) -> None:
    """The same under torchrun with NCCL (one rank per GPU; one rank on a one-GPU machine)."""
    nproc = str(torch.cuda.device_count())
    ref_launch = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc, str(TRAINER), "--steps", "30"]
    ref_out = tmp_path / "reference.pt"
    r = subprocess.run([*ref_launch, "--checkpoint-dir", str(tmp_path / "ref-ckpt"), "--out", str(ref_out)],
                       cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "final.pt"
    r = _rlsup(tmp_path, ["--checkpoint-dir", "ckpt", "--", *ref_launch, "--out", str(out), "--crash-at-step", "13"])
    assert r.returncode == 0, r.stdout + r.stderr
    inc = incidents(tmp_path / ".rlsup")
    assert len(inc) == 1 and inc[0]["resumed_step"] == 10, inc
    _assert_equal(torch.load(out, weights_only=True), torch.load(ref_out, weights_only=True))


@pytest.mark.timeout(600)
def test_rank_stuck_in_a_cuda_kernel_is_a_hang_with_stacks(tmp_path: Path) -> None:
    """A rank spinning in a GPU kernel, its host thread in cudaDeviceSynchronize: silent, caught as a hang
    within the heartbeat timeout, its stacks in the incident, the job restarted and finished."""
    timeout = 5.0
    out = tmp_path / "final.pt"
    r = _rlsup(tmp_path, ["--checkpoint-dir", "ckpt", "--heartbeat-timeout", str(timeout), "--", PY, str(TRAINER),
                          "--out", str(out), "--hang-at-step", "12", "--steps", "20"])
    assert r.returncode == 0, r.stdout + r.stderr
    inc = incidents(tmp_path / ".rlsup")
    assert len(inc) == 1 and inc[0]["reason"] == "hang", inc
    assert inc[0]["last_step"] == 12, inc
    stacks = "\n".join(inc[0]["stacks"].values())
    assert "_fault" in stacks and "train_cuda.py" in stacks, stacks
    silent = float(inc[0]["detail"].split("silent for ")[1].split("s")[0])
    _report({"figure": "cuda_hang_silence_at_call_s", "heartbeat_timeout_s": timeout, "value": silent})
    assert out.exists()


@pytest.mark.timeout(600)
def test_cuda_out_of_memory_is_recorded(tmp_path: Path) -> None:
    """A real ``torch.OutOfMemoryError``: the attempt's incident is ``cuda_oom`` (supervisor.diagnosis.gpu_failures),
    its detail names the error's line, its output tail carries the error, and the job resumes and finishes."""
    r = _rlsup(tmp_path, ["--checkpoint-dir", "ckpt", "--", PY, str(TRAINER), "--oom-at-step", "7", "--steps", "12"])
    assert r.returncode == 0, r.stdout + r.stderr
    (inc,) = incidents(tmp_path / ".rlsup")
    tail = "\n".join(inc["output_tail"])
    assert "OutOfMemoryError" in tail, inc
    assert (inc["reason"], inc["action"], inc["exit_code"]) == ("cuda_oom", "restart", 1), inc
    assert "CUDA out of memory" in inc["detail"], inc
    assert inc["resumed_step"] == 5, inc
    _report({"figure": "cuda_oom_incident_reason", "value": inc["reason"], "exit_code": inc["exit_code"]})


def _restart_seconds(work: Path, warm: bool, cuda_warm: bool = True) -> float:
    """SIGKILL the rank after step 30; the figure is the time from that kill to the end of the next
    attempt's first step (the trainer prints it, after a CUDA synchronize). ``cuda_warm``: ``--warm-cuda``."""
    launch = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(TRAINER), "--steps", "400",
              "--step-time", "0.02", "--checkpoint-every", "20"]
    proc = subprocess.Popen(rlsup_cmd("run", *FAST, "--warm-launcher", str(warm).lower(), "--warm-cuda",
                                      str(cuda_warm).lower(), "--checkpoint-dir", "ckpt",
                                      "--", *launch), cwd=work, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    state = work / ".rlsup" / "state.json"

    def record() -> dict:
        try:
            return json.loads(state.read_text())
        except (OSError, ValueError):
            return {}

    try:
        wait_for(lambda: proc.poll() is not None or (record().get("last_step") or 0) >= 30, 240, "step 30")
        assert proc.poll() is None
        import psutil

        ranks = [c for c in psutil.Process(record()["job_pid"]).children(recursive=True)
                 if "train_cuda.py" in " ".join(c.cmdline())]
        assert ranks, record()
        killed = time.time()
        ranks[-1].send_signal(signal.SIGKILL)
        wait_for(lambda: proc.poll() is not None or (record().get("attempt", 0) >= 1
                                                     and (record().get("last_step") or 0) > 40),
                 240, "the next attempt's steps")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    line = next(x for x in output.splitlines() if "attempt 1: first step done at" in x)
    if warm:  # the restarted rank came from a warm rank (else the figure would be a cold one)
        assert "local rank(s) started from warm ranks" in output, output[-3000:]
    return float(line.rsplit(" ", 1)[1]) - killed


@pytest.mark.timeout(900)
def test_restart_time_of_a_cuda_job_warm_and_cold(tmp_path: Path) -> None:
    """Restart time of a one-GPU torchrun job, warm launcher on and off, alternating (a figure, not a claim;
    issue 30 adds CUDA-warm ranks and compares against these)."""
    figures: dict[str, list[float]] = {"warm": [], "cold": []}
    for i in range(2):
        for side in ("warm", "cold"):
            work = tmp_path / f"{side}{i}"
            work.mkdir()
            figures[side].append(_restart_seconds(work, warm=side == "warm"))
    for side, values in figures.items():
        _report({"figure": f"cuda_restart_s_{side}_launcher", "values": [round(v, 3) for v in values]})
    assert all(v > 0 for vs in figures.values() for v in vs), figures


@pytest.mark.timeout(900)
def test_restart_time_with_and_without_cuda_warm_ranks(tmp_path: Path) -> None:
    """Restart time of a one-GPU torchrun job under the warm launcher, warm ranks that made their CUDA
    context ahead (``warm_cuda: true``; off by default) against import-only ones, alternating (a figure)."""
    figures: dict[str, list[float]] = {"cuda_warm": [], "import_only": []}
    for i in range(3):
        for side in (("cuda_warm", "import_only") if i % 2 == 0 else ("import_only", "cuda_warm")):
            work = tmp_path / f"{side}{i}"
            work.mkdir()
            figures[side].append(_restart_seconds(work, warm=True, cuda_warm=side == "cuda_warm"))
    for side, values in figures.items():
        _report({"figure": f"cuda_restart_s_warm_ranks_{side}", "values": [round(v, 3) for v in values]})
    assert all(v > 0 for vs in figures.values() for v in vs), figures


@pytest.mark.timeout(300)
def test_builtin_pre_launch_check_passes_on_this_gpu_node(tmp_path: Path) -> None:
    """``--pre-launch-check builtin`` on this node: NVML sees the GPUs torchrun asks for, healthy, and the job
    runs (without nvidia-ml-py the check fails by design, naming what to install). Its time in process is
    a figure."""
    from supervisor.diagnosis.gpu_health import check_gpus

    nproc = str(torch.cuda.device_count())
    script = tmp_path / "job.py"
    script.write_text("import torch\nassert torch.cuda.is_available()\n")
    launch = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc, str(script)]
    r = _rlsup(tmp_path, ["--pre-launch-check", "builtin", "--", *launch])
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert r.returncode == 77 and "NVML bindings missing" in r.stderr, r.stderr
        pytest.skip("nvidia-ml-py is not installed here: the builtin check failed as designed")
    assert r.returncode == 0, r.stderr
    assert f"pre_launch_check builtin: {nproc} GPU(s) healthy, {nproc} asked" in r.stderr, r.stderr
    times, detail = [], ""
    for _ in range(20):
        result = check_gpus(launch)
        assert result.ok, result
        times.append(result.seconds * 1e3)
        detail = result.detail
    _report({"figure": "builtin_pre_launch_check_ms", "first": round(times[0], 3),
             "median": round(sorted(times)[len(times) // 2], 3), "detail": detail})


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs 2+ GPUs")
def test_flight_recorder_names_the_nccl_rank_that_skipped_a_collective(tmp_path: Path) -> None:
    """tests/jobs/fr_skip_job.py on NCCL, one rank per GPU (up to 4): the last rank skips one all-reduce
    of the default group; rlsup's Flight Recorder verdict (NCCL's own ring) names it and the collective."""
    nproc = min(4, torch.cuda.device_count())
    skipper = nproc - 1
    env = clean_env(FR_JOB_DEVICE="cuda", FR_JOB_SKIPPER=str(skipper))
    job = ROOT / "tests" / "jobs" / "fr_skip_job.py"
    r = subprocess.run(rlsup_cmd("run", *FAST, "--heartbeat-timeout", "10", "--", PY, "-m", "torch.distributed.run",
                                 "--standalone", "--nproc-per-node", str(nproc), str(job)),
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    (inc,) = incidents(tmp_path / ".rlsup")
    verdict = inc["fr_verdict"]
    assert inc["reason"] == "hang" and inc["suspect_ranks"] == [skipper], inc
    assert "wait in all_reduce #" in verdict and f"rank {skipper} last completed #" in verdict, verdict
    assert f"suspect rank {skipper} on node" in verdict and "metrics" in verdict, verdict
    _report({"figure": "nccl_flight_recorder_verdict", "nproc": nproc, "value": verdict})
