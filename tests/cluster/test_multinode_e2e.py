"""Three node supervisors on 127.0.0.1 (own ports, own directories) around a 3-node torchrun job,
launched as PyTorch documents multi-node jobs: ``--rdzv-backend c10d --rdzv-endpoint``.

Shows: every checkpoint part reaches its replica holder with matching checksums; a node SIGKILLed and
wiped is replaced by one with an empty disk, and all nodes resume from the newest step whose parts
survive, ending bit-identical to an uninterrupted run; a corrupted replica is never used. c10d orders
nodes by join order (and ignores --node-rank); rlsup pins each node's ranks, so every rank resumes from
its own part, and what rlsup says it resumed ("from step N") is what every trainer loaded. Losing node 0
(which hosts the embedded coordination store and torchrun's master) is survived the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlsup_format.manifest import hash_file, list_step_dirs, manifest_name, read_manifest
from support.cluster import (HELD_FOR_NODE_0_LOSS, HELD_PATIENCE, NODES, Cluster, assert_resumed_at_least,
                             assert_same_weights, lose_node_0_and_replace, reference_weights, replica_ns, replica_part,
                             rlsup_resumes, trainer_starts)
from support.incidents import incidents
from support.procs import run_rlsup
from support.waits import wait_for


def test_replicas_match_then_node_loss_resumes_bit_identical(tmp_path: Path) -> None:
    ref = reference_weights(tmp_path)
    cluster = Cluster(tmp_path)
    try:
        for node in range(NODES):
            cluster.start(node)
        # Node 2's parts are replicated to node 0 (ring, factor 1). Wait for step 12's copy, then lose node 2.
        wait_for(lambda: (replica_part(cluster, 0, 2, 12) / manifest_name(2)).exists(), 180,
                 "node 2's step 12 part replicated to node 0")
        cluster.lose(2)  # the node and its disk are gone
        # Corrupt node 0's replica of the newest node-2 step it holds: it must never be used.
        held = [s for s, d in list_step_dirs(replica_ns(cluster.node_dir(0) / "replicas", 2))
                if (d / manifest_name(2)).exists()]
        corrupt_step = max(held)
        victim = replica_part(cluster, 0, 2, corrupt_step) / "rank_00002.pt"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        cluster.start(2)  # the replacement, with an empty directory
        codes = cluster.wait_all(timeout=300)
        assert codes == {0: 0, 1: 0, 2: 0}, cluster.logs()
    finally:
        cluster.kill_all()

    # Every node ended bit-identical to the uninterrupted run (rank 0 writes the weights on node 0).
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)
    # c10d was pinned to rlsup's node ranks, and what rlsup said each launch resumed from is what the
    # trainer loaded (every rank must: a rank missing its part fails the attempt, it never starts fresh).
    log0 = cluster.log(0)
    assert "launcher rendezvous pinned to rlsup's node rank" in log0, log0[-3000:]
    assert trainer_starts(log0) == [r or 0 for r in rlsup_resumes(log0)] and trainer_starts(log0)[-1] > 0, log0[-4000:]
    # The replacement resumed from a step it fetched from a peer, never the corrupted one.
    inc2 = incidents(cluster.node_dir(2) / ".rlsup")
    inc0 = incidents(cluster.node_dir(0) / ".rlsup")
    resumed = [i["resumed_step"] for i in inc0 if i.get("resumed_step") is not None]
    # The newest step whose parts all survive uncorrupted: one checkpoint before the corrupted replica.
    assert resumed and resumed[-1] == corrupt_step - 3, (corrupt_step, inc0)
    assert all(i["reason"] != "success" for i in inc2)
    # Every checkpoint part reached its replica holder with matching checksums.
    for owner in range(NODES):
        holder = (owner + 1) % NODES
        for step, step_dir in list_step_dirs(cluster.node_dir(owner) / "checkpoints"):
            mpath = step_dir / manifest_name(owner)
            if not mpath.exists():
                continue
            replica = replica_part(cluster, holder, owner, step)
            wait_for(lambda: (replica / manifest_name(owner)).exists(), 30, f"replica of node {owner} step {step}")
            manifest = read_manifest(mpath)
            for name, entry in manifest.files.items():
                assert hash_file(replica / name) == entry, f"replica {replica / name} differs"
    # `rlsup status` shows where each step's parts live and the progress per peer.
    status = json.loads(run_rlsup(["status", "--json"], cluster.node_dir(0)).stdout)
    rep = status["replication"]
    assert rep["targets"] == [1] and rep["progress"]["1"]["bytes_sent"] > 0
    assert rep["placement"]["9"]["0"] == [f"127.0.0.1:{cluster.repl_ports[1]}"]
    text = run_rlsup(["status"], cluster.node_dir(0)).stdout
    assert "replication: node 0 -> nodes [1]" in text and "step 9: node 0 parts on" in text


def test_node_0_lost_and_replaced_with_an_empty_disk_resumes_bit_identical(tmp_path: Path) -> None:
    """Node 0 hosts the embedded coordination store and torchrun's master. It is SIGKILLed and its disk
    wiped; the other nodes wait for a replacement, which joins with an empty disk, re-hosts the store,
    fetches node 0's parts from their replicas, and the job resumes from a step at least as new as the
    newest one that was complete and replicated when node 0 died, ending bit-identical."""
    ref = reference_weights(tmp_path)
    cluster = Cluster(tmp_path, extra=HELD_PATIENCE, train_args=HELD_FOR_NODE_0_LOSS)
    complete = lose_node_0_and_replace(cluster)
    assert_resumed_at_least(cluster, complete, ref)
    assert "is gone; waiting" in cluster.log(1), cluster.log(1)[-3000:]  # node 1 waited for the new store
