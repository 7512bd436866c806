"""The memory tier on several nodes (issue 16): each node's tier is one more place a part can be.

Unit level: a node's tier holds only its own ranks' parts; the drainer copies them per part at the same
steps on every node, applies ``memory_keep_last`` itself, offers every valid part to the plan, and a
step is resumed in place only when all the node's parts are there.

End to end: two node supervisors on 127.0.0.1 (each in its own directory, its memory tier a temporary
directory standing for /dev/shm) around a 2-node torchrun job that saves every step. A rank SIGKILLed
mid-run: both nodes resume from the newest step both hold in memory, in place. A node lost with its
directories (memory tier included) and replaced by one with empty ones: the job resumes from disk and a
peer's replica. Both end bit-identical to an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlsup_format.manifest import list_step_dirs, manifest_name
from supervisor.tiers.holdings import StepHoldings
from supervisor.tiers.memory_tier import MemorySettings, MemoryTier, job_memory_dir
from supervisor.tiers.node_parts import NodeParts
from trainer_hooks.backends import get_backend
from trainer_hooks.step_writer import RankIdentity, StepTarget, write_step

JOB = "mnmem"
WORLD = 4  # two nodes of two ranks: node 1 runs ranks 2 and 3


def save(directory: Path, step: int, rank: int, node: int, job: str = JOB, world: int = WORLD) -> Path:
    """Rank ``rank``'s part of ``step`` as the trainer writes it into a memory tier (disk keep_last 2)."""
    target = StepTarget(directory, 2, None, disk_keep_last=2)
    payload = {"w": torch.full((4096,), float(step * 10 + rank)), "step": step}
    return write_step(target, step, payload, RankIdentity(rank, world, node, job), get_backend("torch"))


def node_tier(tmp: Path, node: int, **kw: object) -> MemoryTier:
    settings = MemorySettings(job_memory_dir(tmp / "shm", JOB, node), node=node, nodes=2, **kw)  # type: ignore[arg-type]
    return MemoryTier(settings, tmp / f"ckpt{node}", JOB)


def own_steps(directory: Path, ranks: tuple[int, ...]) -> list[int]:
    return [s for s, d in list_step_dirs(directory) if all((d / manifest_name(r)).exists() for r in ranks)]


def test_a_nodes_parts_are_its_contiguous_block_and_whole_only_when_all_verify(tmp_path: Path) -> None:
    view = NodeParts(1, 2, JOB)
    assert view.ranks(4) == {2, 3} and view.ranks(3) is None and NodeParts().ranks(3) == {0, 1, 2}
    root = tmp_path / "shm"
    save(root, 5, 2, 1)
    step_dir = save(root, 5, 3, 1)
    assert sorted(view.whole(step_dir) or {}) == [2, 3]
    (step_dir / manifest_name(3)).unlink()  # rank 3 killed before its manifest: not whole on this node
    assert view.whole(step_dir) is None and sorted(view.valid_parts(step_dir)) == [2]
    assert NodeParts(1, 2, "another-job").valid_parts(step_dir) == {}  # never another job's parts


def test_drains_own_parts_at_the_same_steps_on_every_node_and_keeps_memory_keep_last(tmp_path: Path) -> None:
    """Node 0 polls after every step, node 1 after every other: both drain steps 1, 3, 6, 9 (the first at
    once, then the first step at or past each multiple of disk_every), each only its own parts."""
    tiers = [node_tier(tmp_path, n, disk_every=3, keep_last=2) for n in (0, 1)]
    drained: list[list[int]] = [[], []]
    for step in range(1, 11):
        for node, tier in enumerate(tiers):
            for rank in (2 * node, 2 * node + 1):
                save(tier.root, step, rank, node)
            if node == 0 or step % 2 == 0:
                d = tier.poll()
                if d is not None:
                    drained[node].append(d.step)
                    assert d.parts == 2
    assert drained == [[1, 3, 6, 9], [1, 3, 6, 9]]
    for node, tier in enumerate(tiers):
        ranks = (2 * node, 2 * node + 1)
        assert own_steps(tier.root, ranks) == [9, 10], node  # memory_keep_last, applied by rlsup here
        assert own_steps(tmp_path / f"ckpt{node}", ranks) == [6, 9], node  # the trainer's keep_last on disk
        other = (2 * (1 - node),)
        assert own_steps(tmp_path / f"ckpt{node}", other) == []  # a node drains only its own parts


def test_inventory_offers_every_valid_part_and_a_step_resumes_in_place_only_when_whole(tmp_path: Path) -> None:
    tier = node_tier(tmp_path, 1)
    for rank in (2, 3):
        save(tier.root, 5, rank, 1)
    torn = save(tier.root, 6, 2, 1)  # rank 3 died before saving step 6
    save(tier.root, 7, 2, 1, job="someone-else")
    inv = tier.inventory()
    assert inv.steps[5] == StepHoldings(WORLD, {2: 1, 3: 1}, {})
    assert inv.steps[6].local == {2: 1} and 7 not in inv.steps
    assert tier.resume_dir(5) == tier.root / "step_000000005" and tier.resume_dir(6) is None
    assert tier.copy_to_disk(6) == 1 and tier.copy_to_disk(6) == 0  # a valid part on disk is kept
    assert (tmp_path / "ckpt1" / torn.name / manifest_name(2)).exists()
    assert tier.root.name == f"rlsup-{JOB}-node1"  # each node its own directory, even on one host's tmpfs


def test_memory_retention_waits_while_the_nodes_agree_and_keeps_the_resume_step(tmp_path: Path) -> None:
    tier = node_tier(tmp_path, 0, disk_every=100, keep_last=1)
    for step in (1, 2, 3):
        for rank in (0, 1):
            save(tier.root, step, rank, 0)
    tier.pause_retention(True)
    tier.poll()  # drains step 1 (the first), removes nothing while paused
    assert own_steps(tier.root, (0, 1)) == [1, 2, 3]
    tier.protect(tier.root / "step_000000002")
    tier.pause_retention(False)
    tier.poll()
    assert own_steps(tier.root, (0, 1)) == [2, 3]  # keep_last 1, plus the step being resumed from


def test_an_uneven_world_is_drained_but_never_pruned_nor_resumed_in_place(tmp_path: Path) -> None:
    """3 ranks on 2 nodes: which ranks are node 1's is a guess (the manifests that name it)."""
    tier = node_tier(tmp_path, 1, keep_last=1)
    for step in (1, 2, 3):
        save(tier.root, step, 2, 1, world=3)
        tier.poll()
    assert [d.step for d in tier.drains] == [1, 2, 3]
    assert own_steps(tier.root, (2,)) == [1, 2, 3]  # keep_last 1 not applied: nothing deleted on a guess
    assert tier.inventory().steps[3].local == {2: 1} and tier.resume_dir(3) is None


# ------------------------------------------------------------------------------ real runs


