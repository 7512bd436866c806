"""``coordinator_backend: etcd``: the nodes agree through a real 3-member etcd cluster on 127.0.0.1, so
losing node 0 (and one etcd member with it) stalls nobody: the job finishes bit-identical once a
replacement node 0 joins with an empty disk."""

from __future__ import annotations

from pathlib import Path

from conftest import replica_ns, wait_for
from etcd_cluster import EtcdCluster, etcd_cluster  # noqa: F401 - the fixture
from test_multinode import (NODES, Cluster, assert_same_weights, reference_weights, replica_part, rlsup_resumes,
                            trainer_starts)
from trainer_hooks.manifest import list_step_dirs, manifest_name


def test_etcd_backend_survives_losing_node_0_and_an_etcd_member(tmp_path: Path, etcd_cluster: EtcdCluster) -> None:  # noqa: F811
    ref = reference_weights(tmp_path)
    cluster = Cluster(tmp_path, extra=["--coordinator-backend", "etcd",
                                       "--coordinator-endpoints", ",".join(etcd_cluster.endpoints)])
    try:
        for node in range(NODES):
            cluster.start(node)
        wait_for(lambda: (replica_part(cluster, 1, 0, 9) / manifest_name(0)).exists(), 180,
                 "node 0's step 9 part replicated to node 1")
        etcd_cluster.kill(0)  # the member every node talks to first
        cluster.lose(0)
        held0 = {s for s, d in list_step_dirs(replica_ns(cluster.node_dir(1) / "replicas", 0))
                 if (d / manifest_name(0)).exists()}
        own = [{s for s, d in list_step_dirs(cluster.node_dir(n) / "checkpoints") if (d / manifest_name(n)).exists()}
               for n in (1, 2)]
        complete = max(held0 & own[0] & own[1])  # the newest step complete and replicated at the loss
        cluster.start(0)  # the replacement, with an empty disk
        codes = cluster.wait_all(timeout=300)
        assert codes == {0: 0, 1: 0, 2: 0}, cluster.logs()
    finally:
        cluster.kill_all()
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)
    log0 = cluster.log(0)
    assert "coordination store etcd" in log0, log0[-3000:]
    starts = trainer_starts(log0)
    assert starts and starts[0] >= complete and starts == [r or 0 for r in rlsup_resumes(log0)], log0[-4000:]
    for node in (1, 2):  # the survivors never waited for a store: etcd stayed up with two members
        assert "is gone; waiting" not in cluster.log(node), cluster.log(node)[-3000:]
