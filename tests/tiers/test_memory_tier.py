"""The memory tier (issue 16): ranks save into node memory, rlsup drains to disk and resumes from memory.

Unit tests of the rules (cadence, drain, retention, free space, the end of a run), then real runs under
``rlsup run`` (torchrun, gloo, CPU) that end bit-identical to an uninterrupted run. A temporary
directory stands in for /dev/shm: nothing here needs a tmpfs or mount.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from support.files import count_hashes, saved_step
from support.waits import wait_for
from rlsup_format.manifest import KnownDigests, list_step_dirs, manifest_name, read_manifest, verify_step_dir
from supervisor.config import ConfigError, SupervisorConfig, load_config
from supervisor.job_identity import job_identity
from supervisor.tiers.memory_tier import MemorySettings, MemoryTier, job_memory_dir
from supervisor.tiers.resume import TIER_LOCAL, TIER_MEMORY
from supervisor.tiers.selection import choose_across_tiers
from trainer_hooks.backends import get_backend
from trainer_hooks.memory_tier import MemoryTarget
from trainer_hooks.step_writer import RankIdentity, StepTarget, write_step

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




def test_a_rounds_inventory_and_the_in_place_resume_hash_a_memory_part_once(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42, choose once per failure, for the memory tier of a node in a multi-node round: the inventory the
    node publishes verifies its parts in memory in full, and the in-place resume from the planned step reuses
    those checksums (supervisor.cluster.multinode passes the restart's KnownDigests to both). Without them each
    byte of the step was hashed twice while the job was down; a part rewritten in between is hashed again."""
    mem = tier(tmp_path, node=1, nodes=2)
    saved_step(mem.root, 10, range(1, 2), 2, node_rank=1)
    counts, known = count_hashes(monkeypatch), KnownDigests()
    assert sorted(mem.inventory(known=known).steps) == [10]
    assert mem.resume_dir(10, known) == mem.root / "step_000000010"
    assert counts == {"step_000000010/rank_00001.pt": 1}
    part = mem.root / "step_000000010" / "rank_00001.pt"
    part.write_bytes(bytes(len(part.read_bytes())))  # rewritten in place: its identity changed
    assert mem.resume_dir(10, known) is None
    assert counts == {"step_000000010/rank_00001.pt": 2}
