"""The end-to-end half of test_multinode_memory.py (real processes, or waits on real time): the memory tier on
several nodes (issue 16): each node's tier is one more place a part can be."""

from __future__ import annotations

import json
from pathlib import Path


from support.cluster import Cluster, assert_same_weights, reference_weights, replica_part, rlsup_resumes, trainer_starts
from support.incidents import incidents
from support.waits import wait_for
from rlsup_format.manifest import manifest_name
from test_multinode_memory import own_steps


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
