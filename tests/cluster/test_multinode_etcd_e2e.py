"""``coordinator_backend: etcd``: the nodes agree through a real 3-member etcd cluster on 127.0.0.1, so
losing node 0 (and one etcd member with it) stalls nobody: the job finishes bit-identical once a
replacement node 0 joins with an empty disk."""

from __future__ import annotations

from pathlib import Path

from etcd_cluster import EtcdCluster, etcd_cluster  # noqa: F401 - the fixture
from support.cluster import (HELD_FOR_NODE_0_LOSS, HELD_PATIENCE, Cluster, assert_resumed_at_least,
                             lose_node_0_and_replace, reference_weights)


def test_etcd_backend_survives_losing_node_0_and_an_etcd_member(tmp_path: Path, etcd_cluster: EtcdCluster) -> None:  # noqa: F811
    ref = reference_weights(tmp_path)
    cluster = Cluster(tmp_path, extra=["--coordinator-backend", "etcd",
                                       "--coordinator-endpoints", ",".join(etcd_cluster.endpoints), *HELD_PATIENCE],
                      train_args=HELD_FOR_NODE_0_LOSS)
    # The member every node talks to first dies with node 0.
    complete = lose_node_0_and_replace(cluster, before_loss=lambda: etcd_cluster.kill(0))
    assert_resumed_at_least(cluster, complete, ref)
    assert "coordination store etcd" in cluster.log(0), cluster.log(0)[-3000:]
    for node in (1, 2):  # the survivors never waited for a store: etcd stayed up with two members
        assert "is gone; waiting" not in cluster.log(node), cluster.log(node)[-3000:]
