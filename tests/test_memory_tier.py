"""The memory tier (issue 16): ranks save into node memory, rlsup drains to disk and resumes from memory.

Unit tests of the rules (cadence, drain, retention, free space, the end of a run), then real runs under
``rlsup run`` (torchrun, gloo, CPU) that end bit-identical to an uninterrupted run. A temporary
directory stands in for /dev/shm: nothing here needs a tmpfs or mount.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from support.env import ROOT, clean_env
from support.incidents import incidents
from support.procs import start_rlsup
from support.waits import wait_for
from rlsup_format.manifest import list_step_dirs, manifest_name, read_manifest, verify_step_dir
from supervisor.config import ConfigError, SupervisorConfig, load_config
from supervisor.job_identity import job_identity
from supervisor.tiers.memory_tier import MemorySettings, MemoryTier, job_memory_dir
from supervisor.tiers.resume import TIER_LOCAL, TIER_MEMORY
from supervisor.tiers.selection import choose_across_tiers
from trainer_hooks.backends import get_backend
from trainer_hooks.memory_tier import MemoryTarget
from trainer_hooks.step_writer import RankIdentity, StepTarget, write_step

TRAIN = str(ROOT / "examples" / "train_tiny.py")
PY = sys.executable
JOB = "memjob"


def save(directory: Path, step: int, keep_last: int | None = None, resume: str | None = None,
         disk_keep_last: int | None = None, mb: int = 1) -> Path:
    """One single-rank step written by the trainer's own protocol."""
    payload = {"w": torch.full((mb * 2**18,), float(step)), "step": step}
    target = StepTarget(directory, keep_last, resume, disk_keep_last=disk_keep_last)
    return write_step(target, step, payload, RankIdentity(0, 1, None, JOB), get_backend("torch"))


def valid_steps(directory: Path) -> list[int]:
    return [s for s, d in list_step_dirs(directory) if verify_step_dir(d).valid]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tier(tmp: Path, clock: Clock | None = None, **kw: object) -> MemoryTier:
    settings = MemorySettings(job_memory_dir(tmp / "shm", JOB), **kw)  # type: ignore[arg-type]
    return MemoryTier(settings, tmp / "ckpt", JOB, clock=clock or Clock())


# ------------------------------------------------------------------------------ unit: the rules


def test_drain_every_n_steps_and_disk_retention_follows_trainer_keep_last(tmp_path: Path) -> None:
    mem = tier(tmp_path, disk_every=3)
    mem.start()
    mem.stop()
    assert mem.poll() is None  # nothing in memory yet
    drained = []
    for step in range(1, 11):
        save(mem.root, step, keep_last=2, disk_keep_last=2)
        d = mem.poll()
        if d is not None:
            drained.append(d.step)
    assert drained == [1, 4, 7, 10]  # the first at once, then every 3 steps
    assert valid_steps(mem.root) == [9, 10]  # memory_keep_last
    assert valid_steps(tmp_path / "ckpt") == [7, 10]  # the trainer's keep_last, recorded in the manifest
    m = read_manifest(tmp_path / "ckpt" / "step_000000010" / manifest_name(0))
    assert m.extra["disk_keep_last"] == 2 and m.extra["job"] == JOB


def test_drain_by_seconds_and_keep_all_without_a_recorded_keep_last(tmp_path: Path) -> None:
    clock = Clock()
    mem = tier(tmp_path, clock, disk_every_seconds=10.0)
    mem.start()
    mem.stop()
    for step in range(1, 6):
        save(mem.root, step, keep_last=2)
        clock.now += 4.0
        mem.poll()
    # step 1 at once (t=4), then step 4 (t=16, 12 s later); nothing is ever deleted on disk
    assert valid_steps(tmp_path / "ckpt") == [1, 4]
    assert MemorySettings(tmp_path, disk_every_seconds=10.0).wake_interval == 1.0


def test_every_new_step_when_no_cadence_and_a_step_already_on_disk_is_not_copied(tmp_path: Path) -> None:
    mem = tier(tmp_path)
    mem.start()
    mem.stop()
    save(mem.root, 1)
    assert mem.poll().step == 1
    save(tmp_path / "ckpt", 2)  # a save that did not fit went to disk itself
    save(mem.root, 2)
    assert mem.poll() is None
    save(mem.root, 3)
    assert mem.poll().step == 3


def test_a_corrupt_memory_step_is_not_drained_and_nothing_valid_is_lost(tmp_path: Path) -> None:
    mem = tier(tmp_path)
    mem.start()
    mem.stop()
    save(mem.root, 1)
    mem.poll()
    step2 = save(mem.root, 2)
    (step2 / "rank_00000.pt").write_bytes(b"torn")
    assert mem.poll() is None
    assert valid_steps(tmp_path / "ckpt") == [1]
    assert not (tmp_path / "ckpt" / "step_000000002").exists()


def test_memory_retention_keeps_the_resume_step(tmp_path: Path) -> None:
    root = tmp_path / "shm"
    first = save(root, 1)
    for step in range(2, 6):
        save(root, step, keep_last=1, resume=str(first))
    assert valid_steps(root) == [1, 5]


def test_finish_removes_the_job_dir_only_after_success_and_a_drain(tmp_path: Path) -> None:
    mem = tier(tmp_path, disk_every=100)
    mem.start()
    save(mem.root, 1)
    wait_for(lambda: valid_steps(tmp_path / "ckpt") == [1], 20, "step 1 drained (woken by its manifest)")
    save(mem.root, 2)
    assert mem.finish(remove=False, timeout=30) == 2  # a stop: drained whatever the cadence, kept
    assert valid_steps(mem.root) == [1, 2]
    mem2 = tier(tmp_path, disk_every=100)  # a successor for the same job finds the same directory
    assert mem2.root == mem.root and mem2.newest_valid()[0] == 2
    mem2.start()
    save(mem2.root, 3)
    assert mem2.finish(remove=True, timeout=30) == 3
    assert not mem2.root.exists() and valid_steps(tmp_path / "ckpt")[-1] == 3


def test_restart_selection_prefers_the_newest_and_memory_on_a_tie(tmp_path: Path) -> None:
    mem = tier(tmp_path)
    save(tmp_path / "ckpt", 4)
    save(mem.root, 3)
    point = choose_across_tiers(tmp_path / "ckpt", None, job=JOB, memory=mem)
    assert (point.step, point.tier) == (4, TIER_LOCAL)
    save(mem.root, 4)
    point = choose_across_tiers(tmp_path / "ckpt", None, job=JOB, memory=mem)
    assert (point.step, point.tier, point.path) == (4, TIER_MEMORY, mem.root / "step_000000004")


def test_a_step_that_does_not_fit_goes_to_disk_with_a_clear_message(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    disk = StepTarget(tmp_path / "ckpt", 3)
    payload = {"w": torch.zeros(2**20)}  # 4 MiB
    roomy = MemoryTarget(tmp_path / "shm", 2, limit_bytes=64 << 20)
    assert roomy.choose(1, payload, disk).directory == tmp_path / "shm"
    tight = MemoryTarget(tmp_path / "shm", 2, limit_bytes=3 << 20)
    with caplog.at_level(logging.WARNING, logger="trainer_hooks.memory_tier"):
        assert tight.choose(2, payload, disk) == disk
    line = caplog.records[-1].getMessage()
    assert "memory tier full: step 2 needs about" in line and str(tmp_path / "shm") in line
    assert f"{3 << 20} bytes free" in line and f"saved to {tmp_path / 'ckpt'}" in line


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


def test_two_jobs_on_one_host_never_share_a_memory_dir(tmp_path: Path) -> None:
    a = job_identity("", str(tmp_path / "a" / "checkpoints"), multi_node=False)
    b = job_identity("", str(tmp_path / "b" / "checkpoints"), multi_node=False)
    again = job_identity("", str(tmp_path / "a" / "checkpoints"), multi_node=False)
    cfg = SupervisorConfig(memory_dir=str(tmp_path / "shm"))
    dirs = {MemoryTier.from_config(cfg, tmp_path, j.id).root for j in (a, b)}
    assert len(dirs) == 2
    assert MemoryTier.from_config(cfg, tmp_path, again.id).root in dirs
    assert MemoryTier.from_config(SupervisorConfig(), tmp_path, a.id) is None  # memory_dir empty: off


def test_config_keys_are_validated() -> None:
    with pytest.raises(ConfigError, match="memory_keep_last"):
        load_config(environ={}, overrides={"memory_keep_last": 0})
    with pytest.raises(ConfigError, match="disk_every"):
        load_config(environ={}, overrides={"disk_every": -1})
    with pytest.raises(ConfigError, match="memory_limit_bytes"):
        load_config(environ={}, overrides={"memory_limit_bytes": -5})
    cfg = load_config(environ={"RLSUP_MEMORY_DIR": "/dev/shm", "RLSUP_DISK_EVERY": "20"}).config
    assert (cfg.memory_dir, cfg.disk_every, cfg.memory_keep_last) == ("/dev/shm", 20, 2)


# ------------------------------------------------------------------------------ real runs


def launcher(world: int) -> list[str]:
    if world == 1:
        return [PY, TRAIN]
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), TRAIN]


@pytest.fixture
def reference(workdir: Path) -> Iterator[Callable[[int, list[str]], Callable[[], dict[str, torch.Tensor]]]]:
    """Starts the uninterrupted run (no rlsup) to run alongside the supervised one (they share only the cores);
    the call it returns waits for that run and gives its final weights."""
    procs: list[subprocess.Popen] = []

    def start(world: int, train: list[str]) -> Callable[[], dict[str, torch.Tensor]]:
        out = workdir / "reference.pt"
        proc = subprocess.Popen([*launcher(world), *train, "--step-time", "0", "--checkpoint-dir",
                                 str(workdir / "ref"), "--out", str(out)], env=clean_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        procs.append(proc)

        def weights() -> dict[str, torch.Tensor]:
            log, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, log[-4000:]
            return torch.load(out, weights_only=True)

        return weights

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
    proc = start_rlsup([*run_args(shm, "--disk-every", "10"), "--", *launcher(2), *train, "--crash-at-step", "13",
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
    proc = start_rlsup([*run_args(shm, "--memory-limit-bytes", str(20 << 20), "--disk-every", "100"), "--",
                        *launcher(2), *train, "--crash-at-step", "13", "--out", str(out)], workdir)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    assert "memory tier full: step 6 needs about" in output and f"saved to {workdir / 'checkpoints'}" in output
    inc = incidents(workdir / ".rlsup")
    assert len(inc) == 1 and inc[0]["resumed_tier"] == "local" and inc[0]["resumed_step"] == 12, inc
    assert_identical(out, ref())
    assert valid_steps(workdir / "checkpoints")[-1] == 20


def test_collective_backends_save_to_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    from trainer_hooks.checkpoint import CheckpointManager

    monkeypatch.setenv("RLSUP_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("RLSUP_MEMORY_DIR", str(tmp_path / "shm"))
    assert CheckpointManager(backend="torch")._memory_tier() is not None
    assert CheckpointManager(tmp_path / "elsewhere")._memory_tier() is None  # a directory rlsup does not watch
    with caplog.at_level(logging.WARNING):
        assert CheckpointManager(backend="dcp")._memory_tier() is None
    assert "saves collectively" in caplog.text


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
