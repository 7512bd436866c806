"""The end-to-end half of test_memory_tier.py (real processes, or waits on real time): the memory tier (issue 16):
ranks save into node memory, rlsup drains to disk and resumes from memory."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from support.env import ROOT, clean_env
from support.forked_ranks import ForkedPhase, ForkedRun
from support.incidents import incidents
from support.procs import start_rlsup
from support.waits import wait_for
from rlsup_format.manifest import manifest_name, read_manifest
from test_memory_tier import valid_steps
from trainer_hooks.memory_tier import MemoryTarget
from trainer_hooks.step_writer import StepTarget

TRAIN = str(ROOT / "examples" / "train_tiny.py")
PY = sys.executable


# ------------------------------------------------------------------------------ unit: the rules


def test_async_save_goes_to_the_memory_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_hooks.checkpoint import CheckpointManager

    shm = tmp_path / "shm"
    monkeypatch.setenv("RLSUP_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("RLSUP_MEMORY_DIR", str(shm))
    monkeypatch.setenv("RLSUP_MEMORY_KEEP_LAST", "1")
    ckpt = CheckpointManager(keep_last=3, async_save=True)
    state = {"w": torch.arange(1000.0)}
    try:
        for step in (1, 2):
            ckpt.save(step, state)
        ckpt.wait()
    finally:
        ckpt.close()
    assert valid_steps(shm) == [2] and not (tmp_path / "ckpt").exists()
    assert read_manifest(shm / "step_000000002" / manifest_name(0)).extra["disk_keep_last"] == 3
    monkeypatch.setenv("RLSUP_RESUME_DIR", str(shm / "step_000000002"))  # resume in place, from memory
    state["w"] = torch.zeros(1000)
    assert CheckpointManager(keep_last=3).restore(state) == 2 and torch.equal(state["w"], torch.arange(1000.0))


# ------------------------------------------------------------------------------ real runs


def launcher(world: int) -> list[str]:
    if world == 1:
        return [PY, TRAIN]
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), TRAIN]


@pytest.fixture
def reference(workdir: Path) -> Iterator[Callable[[int, list[str]], Callable[[], dict[str, torch.Tensor]]]]:
    """Starts the uninterrupted run (no rlsup; 2+ ranks forked as torchrun's, :mod:`support.forked_ranks`) to run
    alongside the supervised one (they share only the cores); the call it returns waits for that run and gives
    its final weights."""
    runs: list[ForkedRun | subprocess.Popen] = []

    def start(world: int, train: list[str]) -> Callable[[], dict[str, torch.Tensor]]:
        out = workdir / "reference.pt"
        args = [*train, "--step-time", "0", "--checkpoint-dir", str(workdir / "ref"), "--out", str(out)]
        if world > 1:
            (workdir / "reference").mkdir()
            run = ForkedRun(TRAIN, [ForkedPhase(world, tuple(args), str(workdir / "reference" / "rank"))],
                            workdir / "reference", clean_env())
            runs.append(run)

            def weights() -> dict[str, torch.Tensor]:
                run.result(timeout=300)
                return torch.load(out, weights_only=True)
            return weights
        proc = subprocess.Popen([PY, TRAIN, *args], env=clean_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        runs.append(proc)

        def weights_of_one() -> dict[str, torch.Tensor]:
            log, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, log[-4000:]
            return torch.load(out, weights_only=True)
        return weights_of_one

    yield start
    for run in runs:
        if isinstance(run, ForkedRun):
            run.stop()
        elif run.poll() is None:
            run.kill()
            run.wait()


def assert_identical(out: Path, ref: dict[str, torch.Tensor]) -> None:
    final = torch.load(out, weights_only=True)
    assert final.keys() == ref.keys()
    for name in ref:
        assert torch.equal(final[name], ref[name]), f"{name} differs from the uninterrupted run"


def memory_job_dir(shm: Path) -> Path:
    found = sorted(shm.glob("rlsup-*")) if shm.is_dir() else []
    assert len(found) <= 1, found
    return found[0] if found else shm / "rlsup-missing"


def run_args(shm: Path, *extra: str) -> list[str]:
    return ["run", "--memory-dir", str(shm), "--backoff-initial", "0.05", "--backoff-max", "0.1",
            "--heartbeat-timeout", "60", *extra]


def test_rank_sigkill_resumes_from_memory_bit_identical_and_success_removes_the_dir(workdir: Path,
                                                                                  reference: Callable) -> None:
    train = ["--steps", "24", "--checkpoint-every", "1", "--step-time", "0.03", "--ballast-mb", "4",
             "--keep-last", "2", "--async-save"]
    ref = reference(2, train)
    shm, out = workdir / "shm", workdir / "final.pt"
    # --max-restarts 1: the one crash (attempt 1 arms no warm launcher it would never use)
    proc = start_rlsup([*run_args(shm, "--disk-every", "10", "--max-restarts", "1"), "--", *launcher(2), *train,
                        "--crash-at-step", "13",
                        "--out", str(out)], workdir)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    inc = incidents(workdir / ".rlsup")
    assert len(inc) == 1 and inc[0]["action"] == "restart", inc  # how the death is classified is not this test's
    # One async save in flight per rank: rank 1 dies after save(13) returned, so its step 12 is complete, but
    # rank 0 may still be writing step 12 (it passed save(12), which waited only for step 11) when it is stopped.
    assert inc[0]["resumed_tier"] == "memory" and inc[0]["resumed_step"] >= 11, inc[0]
    assert inc[0]["resumed_from"].startswith(str(shm)), inc[0]
    assert "2 local rank(s) started from warm ranks" in output, output[-4000:]  # warm ranks on, as by default
    assert_identical(out, ref())
    assert not any(shm.iterdir()), "a successful run removes its memory directory"
    disk = valid_steps(workdir / "checkpoints")
    assert disk[-1] == 24 and len(disk) == 2, disk  # drained at the end; the trainer's keep_last on disk


def test_rlsup_sigkilled_successor_resumes_from_memory_bit_identical(workdir: Path, reference: Callable) -> None:
    train = ["--steps", "30", "--checkpoint-every", "1", "--step-time", "0.1", "--ballast-mb", "2",
             "--keep-last", "2"]
    ref = reference(1, train)
    shm, out = workdir / "shm", workdir / "final.pt"
    args = [*run_args(shm, "--disk-every", "100"), "--", *launcher(1), *train, "--out", str(out)]
    proc = start_rlsup(args, workdir)
    try:
        wait_for(lambda: max(valid_steps(memory_job_dir(shm)), default=0) >= 8, 120, "step 8 valid in memory")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    in_memory = max(valid_steps(memory_job_dir(shm)))
    assert max(valid_steps(workdir / "checkpoints"), default=0) < in_memory
    proc = start_rlsup(args, workdir)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    assert incidents(workdir / ".rlsup")[-1]["reason"] == "supervisor_lost"
    state = json.loads((workdir / ".rlsup" / "state.json").read_text())
    assert state["resume_tier"] == "memory" and state["resume_step"] >= in_memory, (in_memory, state)
    assert_identical(out, ref())


def test_memory_too_small_saves_to_disk_with_a_clear_message_bit_identical(workdir: Path, reference: Callable) -> None:
    """Room for two steps: later saves go to disk and say so; a crash resumes from disk, exact."""
    train = ["--steps", "20", "--checkpoint-every", "2", "--step-time", "0.03", "--ballast-mb", "4",
             "--keep-last", "2"]
    ref = reference(2, train)
    shm, out = workdir / "shm", workdir / "final.pt"
    # cold restarts: the memory tier with warm ranks (rlsup's default) is this module's other crash tests'
    proc = start_rlsup([*run_args(shm, "--memory-limit-bytes", str(20 << 20), "--disk-every", "100",
                                  "--warm-launcher", "false"), "--",
                        *launcher(2), *train, "--crash-at-step", "13", "--out", str(out)], workdir)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    assert "memory tier full: step 6 needs about" in output and f"saved to {workdir / 'checkpoints'}" in output
    inc = incidents(workdir / ".rlsup")
    assert len(inc) == 1 and inc[0]["resumed_tier"] == "local" and inc[0]["resumed_step"] == 12, inc
    assert_identical(out, ref())
    assert valid_steps(workdir / "checkpoints")[-1] == 20


def test_multi_node_memory_tier_refuses_a_time_cadence(workdir: Path) -> None:
    """On several nodes the drained steps must be the same on every node: disk_every_seconds cannot say so."""
    from support.procs import run_rlsup

    result = run_rlsup(["run", "--memory-dir", str(workdir / "shm"), "--disk-every-seconds", "5", "--peers",
                        "127.0.0.1:9001,127.0.0.1:9002", "--node-rank", "0", "--", PY, "-c", "pass"], workdir)
    assert result.returncode == 2 and "key 'disk_every_seconds'" in result.stderr, result.stderr
    assert "use disk_every" in result.stderr


def test_stopped_run_drains_to_disk_and_keeps_the_memory_dir(workdir: Path) -> None:
    train = ["--steps", "200", "--checkpoint-every", "1", "--step-time", "0.05", "--keep-last", "2"]
    shm = workdir / "shm"
    proc = start_rlsup([*run_args(shm, "--disk-every", "1000", "--stop-grace", "30"), "--", *launcher(1), *train],
                       workdir)
    try:
        wait_for(lambda: max(valid_steps(memory_job_dir(shm)), default=0) >= 6, 120, "step 6 valid in memory")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output[-3000:]
    in_memory = valid_steps(memory_job_dir(shm))
    assert in_memory, "a stopped run keeps its memory directory"
    assert valid_steps(workdir / "checkpoints")[-1] == in_memory[-1], output[-3000:]


def test_a_real_tmpfs_too_small_is_seen_by_its_free_space(tmp_path: Path) -> None:
    """Where mounting is allowed (root, no container limits): an 8 MiB tmpfs, no memory_limit_bytes."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        disk = StepTarget(tmp_path / "ckpt", 3)
        target = MemoryTarget(mnt / "rlsup-job", 2)
        assert target.choose(1, {"w": torch.zeros(2**20)}, disk).directory == mnt / "rlsup-job"  # 4 MiB fits
        assert target.choose(2, {"w": torch.zeros(3 * 2**20)}, disk) == disk  # 12 MiB does not
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)

