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

import json
from pathlib import Path

import torch

from support.cluster import Cluster, assert_same_weights, reference_weights, replica_part, rlsup_resumes, trainer_starts
from support.incidents import incidents
from support.waits import wait_for
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

NODES = 2
TRAIN = ["--steps", "24", "--checkpoint-every", "1", "--step-time", "0.15", "--keep-last", "2"]
MEMORY = ["--memory-dir", "shm", "--memory-keep-last", "2"]  # per node: relative to its own directory


def memory_steps(cluster: Cluster, node: int) -> list[int]:
    found = sorted((cluster.node_dir(node) / "shm").glob("rlsup-*"))
    return own_steps(found[0], (node,)) if found else []


def test_rank_sigkill_all_nodes_resume_from_memory_bit_identical(tmp_path: Path) -> None:
    """Rank 1 (node 1) is SIGKILLed after saving step 13; disk has only every 10th step. Both nodes
    resume from step 13, each from its own memory tier, in place; the run ends bit-identical and
    removes both memory directories."""
    train = [*TRAIN, "--crash-at-step", "13", "--fault-rank", "1"]
    ref = reference_weights(tmp_path, NODES, TRAIN)
    cluster = Cluster(tmp_path, nodes=NODES, extra=[*MEMORY, "--disk-every", "10"], train_args=train)
    try:
        for node in range(NODES):
            cluster.start(node)
        codes = cluster.wait_all(timeout=240)
        assert codes == {0: 0, 1: 0}, cluster.logs()
    finally:
        cluster.kill_all()
    for node in range(NODES):
        inc = [i for i in incidents(cluster.node_dir(node) / ".rlsup") if i.get("resumed_step") is not None]
        assert inc and inc[0]["resumed_tier"] == "memory" and inc[0]["resumed_step"] == 13, (node, inc)
        assert inc[0]["resumed_from"].startswith(str(cluster.node_dir(node) / "shm")), inc[0]
        assert not any((cluster.node_dir(node) / "shm").iterdir()), "a successful run removes its memory dir"
        assert own_steps(cluster.node_dir(node) / "checkpoints", (node,))[-1] == 24  # drained at the end
    log0 = cluster.log(0)
    assert trainer_starts(log0) == [r or 0 for r in rlsup_resumes(log0)] == [0, 13], log0[-4000:]
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)


def test_node_lost_with_its_memory_resumes_from_disk_and_a_peer_bit_identical(tmp_path: Path) -> None:
    """Node 1 is SIGKILLed and its directories (memory tier included) taken away once its step-10 part
    (drained every 5 steps) is replicated to node 0. The replacement starts empty: the nodes resume from
    the newest step both still hold somewhere, node 1's part fetched from node 0's replica."""
    ref = reference_weights(tmp_path, NODES, TRAIN)
    cluster = Cluster(tmp_path, nodes=NODES, extra=[*MEMORY, "--disk-every", "5"], train_args=TRAIN)
    try:
        for node in range(NODES):
            cluster.start(node)
        wait_for(lambda: (replica_part(cluster, 0, 1, 10) / manifest_name(1)).exists(), 180,
                 "node 1's step 10 part replicated to node 0")
        cluster.lose(1)
        held = {s for s in range(1, 25) if (replica_part(cluster, 0, 1, s) / manifest_name(1)).exists()}
        node0 = set(own_steps(cluster.node_dir(0) / "checkpoints", (0,))) | set(memory_steps(cluster, 0))
        complete = max(held & node0)
        cluster.start(1)  # the replacement: same address, empty directories
        codes = cluster.wait_all(timeout=240)
        assert codes == {0: 0, 1: 0}, cluster.logs()
    finally:
        cluster.kill_all()
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)
    state1 = json.loads((cluster.node_dir(1) / ".rlsup" / "state.json").read_text())  # the replacement's launch
    assert state1["resume_tier"] == "peer" and state1["resume_step"] >= complete, (complete, state1)
    inc0 = [i for i in incidents(cluster.node_dir(0) / ".rlsup") if i.get("resumed_step") is not None]
    assert inc0 and inc0[-1]["resumed_step"] == state1["resume_step"], (inc0, state1)
    assert inc0[-1]["resumed_tier"] in ("local", "memory"), inc0
    log0 = cluster.log(0)
    assert trainer_starts(log0) == [r or 0 for r in rlsup_resumes(log0)], log0[-4000:]
