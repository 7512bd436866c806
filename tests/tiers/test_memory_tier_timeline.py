"""The memory tier across a resume to an older step (several nodes): the steps of the abandoned timeline
are removed at launch, and retention never removes a step a live rank is writing.

Node 0 of two held steps 12 and 13 of its own while node 1 lost its memory: the nodes resume from step
10. Before the fix, the drainer's retention of the tier counted the old 12-13 as the newest valid steps
and removed the new step 11 while rank 1 still wrote it, and the new step 12 found rank 0's old part
"already valid" and kept it: a job resuming from data that is not its own. In process, real files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlsup_format.manifest import list_step_dirs, manifest_name
from rlsup_format.names import Kind, reserved_name, staging_label, step_dir_name
from supervisor.tiers.memory_tier import MemorySettings, MemoryTier, being_written, job_memory_dir
from trainer_hooks.backends import get_backend
from trainer_hooks.step_writer import RankIdentity, StepTarget, write_step

JOB = "mntimeline"
WORLD = 4  # two nodes of two ranks: node 0 runs ranks 0 and 1


def save(directory: Path, step: int, rank: int, value: float) -> Path:
    """Rank ``rank``'s part of ``step`` (node 0) as the trainer writes it into the memory tier."""
    target = StepTarget(directory, 2, None, disk_keep_last=2)
    payload = {"w": torch.full((1024,), value), "step": step}
    return write_step(target, step, payload, RankIdentity(rank, WORLD, 0, JOB), get_backend("torch"))


def node0_tier(tmp: Path) -> MemoryTier:
    settings = MemorySettings(job_memory_dir(tmp / "shm", JOB, 0), keep_last=2, node=0, nodes=2)
    return MemoryTier(settings, tmp / "ckpt0", JOB)


def steps(directory: Path) -> list[int]:
    return [s for s, _ in list_step_dirs(directory)]


def rank_being_written(step_dir: Path, rank: int) -> Path:
    """A save under way: the rank's staging directory, named for this (live) process."""
    staging = step_dir / reserved_name(Kind.STAGING, staging_label(rank))
    staging.mkdir(parents=True)
    return staging


def old_timeline(mem: MemoryTier) -> None:
    """Steps 10, 12 and 13 whole on node 0 (the previous attempt); node 1 only had up to 10."""
    for step in (10, 12, 13):
        for rank in (0, 1):
            save(mem.root, step, rank, float(step))


def test_a_resumed_attempt_removes_newer_steps_and_writes_its_own(tmp_path: Path) -> None:
    mem = node0_tier(tmp_path)
    old_timeline(mem)
    mem.protect(mem.root / step_dir_name(10))  # the nodes agreed on step 10
    assert mem.supersede(10) == [12, 13]
    assert steps(mem.root) == [10] and mem.newest_valid() is not None and mem.newest_valid()[0] == 10
    assert [p.name for p in mem.root.iterdir() if p.name.startswith(".")] == []  # nothing left aside
    save(mem.root, 11, 0, 111.0)
    staging = rank_being_written(mem.root / step_dir_name(11), 1)
    for _ in range(3):
        mem.poll()  # drains 10 and prunes the tier: the new 11 is being written and stays
    assert 11 in steps(mem.root)
    staging.rmdir()
    save(mem.root, 11, 1, 111.0)
    for rank in (0, 1):
        save(mem.root, 12, rank, 1212.0)
    part = torch.load(mem.root / step_dir_name(12) / "rank_00000.pt", weights_only=True)
    assert float(part["w"][0]) == 1212.0  # this timeline's step 12, not the old one's
    assert (mem.root / step_dir_name(12) / manifest_name(1)).exists()
    mem.poll()
    mem.poll()
    assert steps(mem.root) == [10, 11, 12]  # memory_keep_last 2 on this timeline's steps, and the resume step


def test_a_fresh_start_removes_every_step_of_the_abandoned_run(tmp_path: Path) -> None:
    mem = node0_tier(tmp_path)
    old_timeline(mem)
    assert mem.supersede(None) == [10, 12, 13] and steps(mem.root) == []
    assert mem.supersede(None) == []


def test_retention_keeps_an_invalid_step_a_live_rank_is_writing_even_below_newer_valid_ones(tmp_path: Path) -> None:
    """The guard on its own (no supersede): the old rule removed any invalid step older than the newest
    valid one when nothing newer was drained."""
    mem = node0_tier(tmp_path)
    old_timeline(mem)
    step_dir = save(mem.root, 11, 0, 111.0)
    staging = rank_being_written(step_dir, 1)
    assert being_written(step_dir)
    for _ in range(4):
        mem.poll()
    assert 11 in steps(mem.root)
    staging.rmdir()  # the writer is gone without a manifest: a torn step, removed as before
    assert not being_written(step_dir)
    mem.poll()
    assert 11 not in steps(mem.root)


def test_the_abandoned_timelines_parts_on_disk_are_invalidated_and_the_new_ones_drained(tmp_path: Path) -> None:
    """Old steps 12 and 13 drained to disk before the failure: without this, the new 11-13 were never
    drained (disk "already held" a newer step) and the new 12's drain kept the old part as valid."""
    mem = node0_tier(tmp_path)
    old_timeline(mem)
    mem.protect(mem.root / step_dir_name(10))  # the nodes resume from 10, in this node's memory
    while mem.poll() is not None:
        pass  # the previous attempt drained 10, 12 and 13 (the trainer's keep_last 2 on disk)
    disk = tmp_path / "ckpt0"
    assert steps(disk) == [12, 13] and steps(mem.root) == [10, 12, 13]
    mem.supersede(10)
    assert [s for s, d in list_step_dirs(disk) if (d / manifest_name(0)).exists()] == []
    for step in (11, 12):
        for rank in (0, 1):
            save(mem.root, step, rank, 1000.0 + step)
        drained = mem.poll()
        assert drained is not None and drained.step == step
    part = torch.load(disk / step_dir_name(12) / "rank_00000.pt", weights_only=True)
    assert float(part["w"][0]) == 1012.0
