"""Spare nodes: 3 job nodes of 2 ranks each and 1 spare on 127.0.0.1 (own directories, c10d as users type it).

A node SIGKILLed and its disk wiped: the spare takes its node rank, fetches the lost node's parts from their
replica holders, and every node resumes from the newest step whose parts survived, ending bit-identical to an
uninterrupted run; node 0 too (the spare hosts the embedded store again). The time from the loss to the next
attempt's first step is printed with its phases (measured, never asserted).

The etcd and second-loss variants are long: they run with the soak (``pytest tests/cluster/test_multinode_spares_e2e.py --soak 1``).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable

import pytest

from etcd_cluster import EtcdCluster, etcd_cluster  # noqa: F401 - the fixture
from support.cluster import HELD_PATIENCE, assert_same_weights, reference_weights, rlsup_resumes, trainer_starts
from support.spares_cluster import (JOB_NODES, RANKS_PER_NODE, SpareCluster, first_step_after, logged_at,
                                    newest_complete, ranks_of, replicated, takeover_start, took_rank)
from support.waits import wait_for
from supervisor.processes.tree_record import load, record_path

SPARE = JOB_NODES  # the spare's node rank in peers
WORLD = JOB_NODES * RANKS_PER_NODE
# RLSUP_SPARES_BALLAST_MB: extra MB each rank saves (50: the 100 MB per node of issue 31's recovery figure)
BALLAST = ["--ballast-mb", os.environ["RLSUP_SPARES_BALLAST_MB"]] if os.environ.get("RLSUP_SPARES_BALLAST_MB") else []
# 36 steps: the loss comes once step 9 is replicated; with 24, a loaded CI machine once replicated it as training ended,
# and the node was lost in torchrun's exit barrier instead of mid-run (no next attempt to wait for)
TRAIN_ARGS = ["--steps", "36", "--checkpoint-every", "3", "--step-time", "0.15", "--keep-last", "100", *BALLAST]
LONG_ARGS = ["--steps", "48", "--checkpoint-every", "3", "--step-time", "0.15", "--keep-last", "100"]


@pytest.fixture
def soak_only(request: pytest.FixtureRequest) -> None:
    """The long variants run with the soak (as the other soak tests: the option lives in tests/conftest.py)."""
    if not request.config.getoption("--soak", default=None):
        pytest.skip("soak: pass --soak MINUTES")


def _holder(node: int) -> int:
    return (node + 1) % JOB_NODES  # the ring, factor 1


def _lose(cluster: SpareCluster, lost: int, watch: int, step: int) -> tuple[int, float]:
    """Lose node ``lost`` once its step ``step`` parts are replicated; (newest complete step, seconds from the
    loss to the next attempt's start on node ``watch``), with the phases printed."""
    wait_for(lambda: replicated(cluster, _holder(lost), lost, step), 180,
             f"node {lost}'s step {step} parts replicated to node {_holder(lost)}")
    before = len(trainer_starts(cluster.log(watch)))
    lost_at = time.time()
    cluster.lose(lost)
    complete = newest_complete(cluster, lost, _holder(lost), [n for n in range(JOB_NODES) if n != lost])
    started = first_step_after(cluster, watch, before, 180)
    took = logged_at(cluster.log(SPARE), "took node rank")
    print(f"node {lost} lost: spare took its rank after {(took or lost_at) - lost_at:.1f}s; "
          f"next attempt started after {started - lost_at:.1f}s ({_phases(cluster, lost_at, 1 if lost == 0 else 0)})")
    return complete, started - lost_at


def _phases(cluster: SpareCluster, lost_at: float, survivor: int) -> str:
    """When (after the loss) the rlsup logs say each step of the takeover happened: measured, never asserted."""
    spare = cluster.log(SPARE)
    marks = [("survivor's attempt ended", logged_at(cluster.log(survivor), r"attempt \d+ failed")),
             ("spare took the rank", logged_at(spare, "took node rank")),
             ("spare fetching parts", logged_at(spare, r"attempt \d+: fetching ranks")),
             ("spare launched", logged_at(spare, r"attempt \d+: launching"))]
    return ", ".join(f"{name} +{at - lost_at:.1f}s" for name, at in marks if at is not None)


def _run_and_lose(cluster: SpareCluster, lost: int, step: int = 9,
                  more: Callable[[SpareCluster], None] = lambda c: None,
                  waiting: Callable[[SpareCluster], None] = lambda c: None) -> int:
    """Start every node (rlsup's default warm launcher: its ranks forked from one torch import), lose ``lost`` once
    its ``step`` is replicated, and wait for the others to end 0; the newest step complete when it was lost."""
    try:
        for node in range(cluster.nodes):
            cluster.start(node)
        waiting(cluster)
        complete, _ = _lose(cluster, lost, SPARE if lost == 0 else 0, step)
        more(cluster)
        codes = cluster.wait_all(timeout=300)
        alive = {n: c for n, c in codes.items() if n != lost}
        assert alive == {n: 0 for n in alive}, cluster.logs()
    finally:
        cluster.kill_all()
    return complete


def _resumed(log: str) -> list[int]:
    starts = trainer_starts(log)
    assert starts == [r or 0 for r in rlsup_resumes(log)], log[-4000:]
    return starts


def _assert_started_warm(spare_log: str) -> None:
    """The spare's first attempt as a node came from the launcher it armed while waiting: torchrun and every
    rank warm (no cold interpreter and ``import torch`` after the loss; issue 31)."""
    said = takeover_start(spare_log)
    assert any("started by the warm launcher" in line for line in said), said or spare_log[-4000:]
    assert any(f"{RANKS_PER_NODE} local rank(s) started from warm ranks" in line for line in said), said
    assert not any("launching cold" in line for line in said), said


def _launcher_guarded(cluster: SpareCluster) -> None:
    """The waiting spare's launcher is guarded as any job root (its own cgroup, in the record a successor rlsup
    and the guardian end it from), not a stray child that could outlive a SIGKILLed rlsup."""
    spawned = wait_for(lambda: re.search(r"warm launcher pid (\d+) spawned", cluster.log(SPARE)), 120,
                       "the spare's warm launcher")
    pid = int(spawned.group(1))
    record = load(record_path(cluster.node_dir(SPARE) / ".rlsup"))
    roots = {r.pid: r for r in record.roots} if record is not None else {}
    assert pid in roots, (pid, record)
    assert record is not None and (record.cgroup is None or roots[pid].cgroup is not None), record  # no cgroup2 here: none


def test_spare_takes_node_2_after_its_loss_bit_identical(tmp_path: Path) -> None:
    """Node 2 lost once its step 9 is replicated. Attempt 0 holds after step 12 until then (rank 4, on node 2,
    stops; the others wait in its next collective): on a machine loaded far past its cores, step 9's replica once came
    after the job had finished, and the spare never had a loss to take. The weights are TRAIN_ARGS'."""
    ref = reference_weights(tmp_path, nodes=WORLD, train_args=TRAIN_ARGS)
    # --max-restarts 1: the loss is the one failure, so the survivors' attempt after it arms no warm launcher it
    # would never use (CONTRIBUTING.md "Suite time")
    cluster = SpareCluster(tmp_path, extra=[*HELD_PATIENCE, "--max-restarts", "1"],
                           train_args=[*TRAIN_ARGS, "--hang-at-step", "12", "--fault-rank", str(ranks_of(2)[0])])
    complete = _run_and_lose(cluster, lost=2, waiting=_launcher_guarded)
    spare_log = cluster.log(SPARE)
    assert took_rank(spare_log) == 2, spare_log[-4000:]
    assert f"fetching ranks {ranks_of(2)}" in spare_log, spare_log[-4000:]
    _assert_started_warm(spare_log)
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)
    assert _resumed(cluster.log(0))[-1] >= complete > 0, (complete, cluster.log(0)[-4000:])
    assert "node rank 2 is now the spare" in cluster.log(1), cluster.log(1)[-4000:]  # node 1 replicates to it
    for node in (0, 1):  # the survivors' restart after the loss came from their warm launchers (rlsup's default)
        log = cluster.log(node)
        assert re.search(r"attempt [1-9]\d*: started by the warm launcher", log), log[-4000:]


def test_spare_takes_node_0_after_its_loss_bit_identical(tmp_path: Path) -> None:
    """Node 0 hosts the embedded store and torchrun's c10d endpoint: the spare hosts the store again. Attempt 0
    holds after step 12 until node 0 is lost (rank 0 stops, the others wait in its next collective), as
    ``HELD_FOR_NODE_0_LOSS`` does: on a loaded CI machine step 9's replica came as training ended, and nodes 1 and 2
    finished the job without node 0 while the spare waited for them in vain. The weights are TRAIN_ARGS'. Every
    node runs rlsup's default warm launcher; the spare's warm takeover is asserted here, the survivors' warm
    restarts in node 2's case."""
    ref = reference_weights(tmp_path, nodes=WORLD, train_args=TRAIN_ARGS)
    cluster = SpareCluster(tmp_path, extra=HELD_PATIENCE,
                           train_args=[*TRAIN_ARGS, "--hang-at-step", "12", "--fault-rank", "0"])
    complete = _run_and_lose(cluster, lost=0)
    spare_log = cluster.log(SPARE)
    assert took_rank(spare_log) == 0, spare_log[-4000:]
    assert "hosting the coordination store" in spare_log, spare_log[-4000:]
    _assert_started_warm(spare_log)
    assert_same_weights(cluster.node_dir(SPARE) / cluster.out_name, ref)
    assert _resumed(spare_log)[0] >= complete > 0, (complete, spare_log[-4000:])


@pytest.mark.soak
@pytest.mark.usefixtures("soak_only")
def test_spare_takes_node_2_with_static_rendezvous(tmp_path: Path) -> None:
    """torchrun's static rendezvous: the spare was started with ``--node-rank 3``; rlsup launches it with 2."""
    ref = reference_weights(tmp_path, nodes=WORLD, train_args=TRAIN_ARGS)
    cluster = SpareCluster(tmp_path, rdzv="static", train_args=TRAIN_ARGS)
    complete = _run_and_lose(cluster, lost=2)
    spare_log = cluster.log(SPARE)
    assert took_rank(spare_log) == 2 and "--node-rank 2" in spare_log, spare_log[-4000:]
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)
    assert _resumed(cluster.log(0))[-1] >= complete > 0, (complete, cluster.log(0)[-4000:])


@pytest.mark.soak
@pytest.mark.usefixtures("soak_only")
def test_spare_takes_node_0_with_etcd(tmp_path: Path, etcd_cluster: EtcdCluster) -> None:  # noqa: F811
    ref = reference_weights(tmp_path, nodes=WORLD, train_args=TRAIN_ARGS)
    cluster = SpareCluster(tmp_path, train_args=TRAIN_ARGS, extra=["--coordinator-backend", "etcd",
                                            "--coordinator-endpoints", ",".join(etcd_cluster.endpoints)])
    complete = _run_and_lose(cluster, lost=0)
    spare_log = cluster.log(SPARE)
    assert took_rank(spare_log) == 0 and "hosting" not in spare_log, spare_log[-4000:]
    assert_same_weights(cluster.node_dir(SPARE) / cluster.out_name, ref)
    assert _resumed(spare_log)[0] >= complete > 0, (complete, spare_log[-4000:])


def _second_loss(cluster: SpareCluster) -> None:
    """After the spare took node 2: lose node 1 (its parts now replicate to the spare), see the job wait with
    no spare left, then start a replacement node 1 with an empty disk."""
    wait_for(lambda: replicated(cluster, SPARE, 1, 24), 180, "node 1's step 24 parts replicated to the spare")
    cluster.lose(1)
    wait_for(lambda: "waiting for inventories" in cluster.log(0), 60, "node 0 to wait for a node 1")
    cluster.start(1)


@pytest.mark.soak
@pytest.mark.usefixtures("soak_only")
def test_second_loss_with_no_spare_left_waits_for_a_replacement(tmp_path: Path) -> None:
    ref = reference_weights(tmp_path, nodes=WORLD, train_args=LONG_ARGS)
    cluster = SpareCluster(tmp_path, train_args=LONG_ARGS)
    _run_and_lose(cluster, lost=2, more=_second_loss)
    assert took_rank(cluster.log(SPARE)) == 2, cluster.log(SPARE)[-4000:]
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)
    log1 = cluster.log(1)  # the replacement's (rank 0, which prints, is on node 0)
    assert "fetching ranks [2, 3]" in log1 and "(from node 2)" in log1, log1[-4000:]  # from the spare
    assert (rlsup_resumes(log1)[0] or 0) >= 24 and _resumed(cluster.log(0))[-1] >= 24, log1[-4000:]


@pytest.mark.soak
@pytest.mark.usefixtures("soak_only")
def test_an_unused_spare_exits_0_when_the_job_succeeds(tmp_path: Path) -> None:
    cluster = SpareCluster(tmp_path, train_args=TRAIN_ARGS)
    try:
        for node in range(cluster.nodes):
            cluster.start(node)
        codes = cluster.wait_all(timeout=300)
    finally:
        cluster.kill_all()
    assert codes == {n: 0 for n in range(cluster.nodes)}, cluster.logs()
    assert took_rank(cluster.log(SPARE)) is None
    assert "the job ended without needing this spare" in cluster.log(SPARE), cluster.log(SPARE)[-3000:]
