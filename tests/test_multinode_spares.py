"""Spare nodes: 3 job nodes of 2 ranks each and 1 spare on 127.0.0.1 (own directories, c10d as users type it).

A node SIGKILLed and its disk wiped: the spare takes its node rank, fetches the lost node's parts from their
replica holders, and every node resumes from the same step, ending bit-identical to an uninterrupted run.
The time from the loss to the next attempt's first step is printed (measured, not asserted).
"""

from __future__ import annotations

import time
from pathlib import Path

from rlsup_format.manifest import manifest_name
from support.cluster import assert_same_weights, reference_weights, replica_part, rlsup_resumes, trainer_starts
from support.spares_cluster import JOB_NODES, RANKS_PER_NODE, SpareCluster, first_step_after, took_rank
from support.waits import wait_for

SPARE = JOB_NODES  # the spare's node rank in peers


def _lose_and_take_over(tmp_path: Path, lost: int, holder: int, step: int = 9) -> tuple[SpareCluster, float]:
    """Start 3 + 1, lose node ``lost`` once its step ``step`` part reached ``holder``; the spare takes over."""
    cluster = SpareCluster(tmp_path)
    try:
        for node in range(cluster.nodes):
            cluster.start(node)
        first_rank = lost * RANKS_PER_NODE
        wait_for(lambda: (replica_part(cluster, holder, lost, step) / manifest_name(first_rank)).exists(), 180,
                 f"node {lost}'s step {step} part replicated to node {holder}")
        watch = 0 if lost != 0 else SPARE  # the node whose rank 0 prints the next attempt's start
        before = len(trainer_starts(cluster.log(watch)))
        lost_at = time.monotonic()
        cluster.lose(lost)
        took = first_step_after(cluster, watch, lost_at, before, 180)
        codes = cluster.wait_all(timeout=300)
        assert {n: c for n, c in codes.items() if n != lost} == {n: 0 for n in range(cluster.nodes) if n != lost}, \
            cluster.logs()
    finally:
        cluster.kill_all()
    return cluster, took


def test_spare_takes_node_2_after_its_loss_bit_identical(tmp_path: Path) -> None:
    ref = reference_weights(tmp_path, nodes=JOB_NODES * RANKS_PER_NODE)
    cluster, took = _lose_and_take_over(tmp_path, lost=2, holder=0)
    print(f"node 2 lost -> first step of the next attempt: {took:.1f}s")
    spare_log = cluster.log(SPARE)
    assert took_rank(spare_log) == 2, spare_log[-4000:]
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)
    log0 = cluster.log(0)
    starts = trainer_starts(log0)
    assert starts == [r or 0 for r in rlsup_resumes(log0)] and starts[-1] >= 9, log0[-4000:]
    assert "fetching ranks [4, 5]" in spare_log, spare_log[-4000:]


def test_spare_takes_node_0_after_its_loss_bit_identical(tmp_path: Path) -> None:
    """Node 0 hosts the embedded store and torchrun's c10d endpoint: the spare hosts the store again."""
    ref = reference_weights(tmp_path, nodes=JOB_NODES * RANKS_PER_NODE)
    cluster, took = _lose_and_take_over(tmp_path, lost=0, holder=1)
    print(f"node 0 lost -> first step of the next attempt: {took:.1f}s")
    spare_log = cluster.log(SPARE)
    assert took_rank(spare_log) == 0, spare_log[-4000:]
    assert_same_weights(cluster.node_dir(SPARE) / cluster.out_name, ref)
    starts = trainer_starts(spare_log)
    assert starts and starts[0] >= 9, spare_log[-4000:]
