"""Three node supervisors on 127.0.0.1 (own ports, own directories) around a 3-node torchrun job,
launched as PyTorch documents multi-node jobs: ``--rdzv-backend c10d --rdzv-endpoint``.

Shows, on one run that loses node 2 and then node 0: every checkpoint part reaches its replica holder with
matching checksums; a node SIGKILLed and wiped is replaced by one with an empty disk, and all nodes resume from
the newest step whose parts survive, ending bit-identical to an uninterrupted run; a corrupted replica is never
used. c10d orders nodes by join order (and ignores --node-rank); rlsup pins each node's ranks, so every rank
resumes from its own part, and what rlsup says it resumed ("from step N") is what every trainer loaded. Losing
node 0 (which hosts the embedded coordination store and torchrun's master) is survived the same way. (Two tests
ran a cluster each for these, node 2's loss and node 0's; one run does both: a whole 3-node run fewer.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlsup_format.manifest import hash_file, list_step_dirs, manifest_name, read_manifest
from support.cluster import (HELD_PATIENCE, NODES, TRAIN_ARGS, Cluster, assert_resumed_at_least, reference_weights,
                             replica_ns, replica_part, rlsup_resumes, trainer_starts)
from support.incidents import incidents
from support.procs import run_rlsup
from support.waits import wait_for

HOLD = 18
# Rank 0 (on node 0) holds after step HOLD (and its save) in attempt 1, the one after node 2's loss, until node 0 is
# lost: the job cannot end before the second loss on a loaded machine (attempt 1 resumes from step 9 or 12, as the
# corrupted replica leaves it). Attempt 0 does not hold: node 2 is lost once its step 12 is replicated. The weights
# are TRAIN_ARGS'; HELD_PATIENCE beside it (the held rank is silent until the loss, which is not a hang).
HELD_IN_ATTEMPT_1 = [*TRAIN_ARGS, "--hang-at-step", str(HOLD), "--fault-rank", "0", "--fault-attempt", "1"]


def lose_node_2_with_a_corrupt_replica(cluster: Cluster) -> int:
    """Lose node 2 once node 0 holds its step 12 part (ring, factor 1), flip a byte of node 0's replica of the
    newest node-2 step it holds (it must never be used), and start node 2's replacement with an empty disk.
    Returns the corrupted step."""
    wait_for(lambda: (replica_part(cluster, 0, 2, 12) / manifest_name(2)).exists(), 180,
             "node 2's step 12 part replicated to node 0")
    cluster.lose(2)  # the node and its disk are gone
    held = [s for s, d in list_step_dirs(replica_ns(cluster.node_dir(0) / "replicas", 2))
            if (d / manifest_name(2)).exists()]
    corrupt_step = max(held)
    victim = replica_part(cluster, 0, 2, corrupt_step) / "rank_00002.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    cluster.start(2)  # the replacement, with an empty directory
    return corrupt_step


def lose_node_0_once_held(cluster: Cluster) -> int:
    """Once attempt 1 holds after step HOLD, its node-0 part replicated to node 1, check ``rlsup status`` on node 0,
    lose node 0 and, once node 1 waits for its store, start its replacement with an empty disk. Returns the newest step that was complete and
    replicated when node 0 died (every resume after must be at least as new)."""
    wait_for(lambda: f"injected hang after step {HOLD}" in cluster.log(0), 180, f"attempt 1 holding after step {HOLD}",
             interval=0.5)
    wait_for(lambda: (replica_part(cluster, 1, 0, HOLD) / manifest_name(0)).exists(), 120,
             f"node 0's step {HOLD} part replicated to node 1", interval=0.5)
    assert_status_shows_replication(cluster)
    for node in range(cluster.nodes):  # a node's supervisor never loads torch (its store and launch parsing are rlsup's)
        libs = cluster.supervisor_libraries(node)
        assert libs and not any(lib.startswith("libtorch") for lib in libs), (node, sorted(libs))
    cluster.lose(0)
    held0 = {s for s, d in list_step_dirs(replica_ns(cluster.node_dir(1) / "replicas", 0))
             if (d / manifest_name(0)).exists()}
    own = [{s for s, d in list_step_dirs(cluster.node_dir(n) / "checkpoints") if (d / manifest_name(n)).exists()}
           for n in range(1, cluster.nodes)]
    # The replacement starts once node 1 waits for the store: started at once, on a loaded machine it once hosted
    # the store again before node 1's attempt had ended, and node 1 never had to wait for it.
    wait_for(lambda: "is gone; waiting" in cluster.log(1), 120, "node 1 to wait for node 0's store", interval=0.5)
    cluster.start(0)  # the replacement: same address, empty directory
    return max(held0.intersection(*own))


def assert_status_shows_replication(cluster: Cluster) -> None:
    """`rlsup status` (node 0, before its loss) shows where each step's parts live and the progress per peer."""
    status = json.loads(run_rlsup(["status", "--json"], cluster.node_dir(0)).stdout)
    rep = status["replication"]
    assert rep["targets"] == [1] and rep["progress"]["1"]["bytes_sent"] > 0, rep
    assert rep["placement"]["9"]["0"] == [f"127.0.0.1:{cluster.repl_ports[1]}"], rep
    text = run_rlsup(["status"], cluster.node_dir(0)).stdout
    assert "replication: node 0 -> nodes [1]" in text and "step 9: node 0 parts on" in text, text


def assert_replicas_match(cluster: Cluster) -> None:
    """Every checkpoint part reached its replica holder with matching checksums."""
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


@pytest.mark.timeout(500)  # two losses and replacements on one run
def test_replicas_match_then_node_2_then_node_0_lost_and_replaced_resume_bit_identical(tmp_path: Path) -> None:
    """test_replicas_match_then_node_loss_resumes_bit_identical and
    test_node_0_lost_and_replaced_with_an_empty_disk_resumes_bit_identical on one run. Node 2 is SIGKILLed and
    wiped, node 0's replica of its newest part corrupted; the replacement (empty disk) fetches node 2's parts and
    every node resumes from the newest step whose parts survive uncorrupted. Then node 0, which hosts the embedded
    coordination store and torchrun's master, is SIGKILLed and wiped; the other nodes wait for a replacement, which
    joins with an empty disk, re-hosts the store, fetches node 0's parts from their replicas, and the job resumes
    from a step at least as new as the newest one complete and replicated when node 0 died, ending bit-identical."""
    ref = reference_weights(tmp_path)
    cluster = Cluster(tmp_path, extra=HELD_PATIENCE, train_args=HELD_IN_ATTEMPT_1)
    try:
        cluster.start_all()
        corrupt_step = lose_node_2_with_a_corrupt_replica(cluster)
        complete = lose_node_0_once_held(cluster)
        codes = cluster.wait_all(timeout=300)
        assert codes == {0: 0, 1: 0, 2: 0}, cluster.logs()
    finally:
        cluster.kill_all()

    # Bit-identical to the uninterrupted run; node 0's replacement resumed (as rlsup said and the trainer loaded)
    # from a step at least as new as the newest complete one; node 1 waited for the new store.
    assert_resumed_at_least(cluster, complete, ref)
    assert "is gone; waiting" in cluster.log(1), cluster.log(1)[-3000:]  # (waited for before the replacement)
    # Node 0 before its loss: c10d was pinned to rlsup's node ranks, and what rlsup said each launch resumed from
    # is what the trainer loaded (every rank must: a rank missing its part fails the attempt, it never starts fresh).
    lost0 = cluster.root / "node0.lost"
    log0 = (lost0 / cluster.log_name).read_text(errors="replace")
    assert "launcher rendezvous pinned to rlsup's node rank" in log0, log0[-3000:]
    assert trainer_starts(log0) == [r or 0 for r in rlsup_resumes(log0)] and trainer_starts(log0)[-1] > 0, log0[-4000:]
    # Node 2's replacement resumed from a step it fetched from a peer, never the corrupted one: the newest step
    # whose parts all survive uncorrupted is one checkpoint before the corrupted replica.
    inc0 = incidents(lost0 / ".rlsup")
    resumed = [i["resumed_step"] for i in inc0 if i.get("resumed_step") is not None]
    assert resumed and resumed[-1] == corrupt_step - 3, (corrupt_step, inc0)
    assert all(i["reason"] != "success" for i in incidents(cluster.node_dir(2) / ".rlsup"))
    assert_replicas_match(cluster)
