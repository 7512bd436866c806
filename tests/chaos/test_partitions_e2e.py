"""Network partitions of a 3-node job, each node in its own network namespace (scenarios_partition.py).

One scenario runs by default (the chaos CI subset): node 2 cut off both ways while the job trains, with the
embedded store, then healed. The others run under the soak marker (``pytest tests/chaos/test_partitions_e2e.py
--soak 1``): node 0 (the store's host) cut off, one-way cuts, a cut during a round, the etcd backend with its
members in the nodes' namespaces, and a cut that outlasts the rendezvous timeout (every node stops, named,
and the same command finishes the job once healed). Without root, ``ip``/``nft`` (or etcd) they skip, saying why.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .scenarios_partition import PartitionPlan, partition_scenario

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ref_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("partition-reference")


def run(plan: PartitionPlan, tmp_path: Path, ref_cache: Path) -> None:
    res, report = partition_scenario(tmp_path / "s", ref_cache, plan)
    print(res.summary())
    print(report.line())
    skips = [p for p in res.problems if p.startswith("SKIP:")]
    if skips:
        pytest.skip(skips[0][5:].strip())
    assert not res.problems, "\n".join(res.problems) + "\n" + res.log[-8000:]


def test_node_2_isolated_and_healed(tmp_path: Path, ref_cache: Path) -> None:
    # Every node fails the attempt the cut hangs, once, and restarts (warm) after the heal: one restart each, so the
    # restarted attempt arms no warm launcher that nothing would use. A second failure would end that node's
    # run: the exit codes say so.
    run(PartitionPlan("node2_both", cut=(2,), max_restarts=1), tmp_path, ref_cache)


SOAK = [
    PartitionPlan("node0_both", cut=(0,)),
    PartitionPlan("node2_out_only", cut=(2,), direction="out"),
    PartitionPlan("node2_in_only", cut=(2,), direction="in"),
    PartitionPlan("node2_during_round", cut=(2,), during="round"),
    PartitionPlan("etcd_node2_both", cut=(2,), backend="etcd"),
    PartitionPlan("etcd_node0_both", cut=(0,), backend="etcd"),
    PartitionPlan("node2_never_healed", cut=(2,), heal=False),
]


@pytest.mark.soak
@pytest.mark.parametrize("plan", SOAK, ids=[p.name for p in SOAK])
def test_partition_soak(plan: PartitionPlan, tmp_path: Path, ref_cache: Path) -> None:
    run(plan, tmp_path, ref_cache)
