"""Shrink (issue 43): a job of 3 nodes that loses one, with no spare left, goes on with the 2 it has when
``min_nodes`` allows it and its saves are resizable (:mod:`support.shrink_cluster`: real rlsup, 3 nodes on
127.0.0.1, each its own directory, torchrun typed with c10d).

- Resizable saves, ``--min-nodes 2``, FSDP2 (dcp, replication_factor 2): nodes 0 and 1 end 0 (the shrunk job runs
  to its end), saying (log and incident) they continued on 2 of 3 nodes from HELD; the final weights equal a run
  without rlsup (3 ranks to HELD, then 2 ranks from that save) bit for bit, and over the kept steps every rank's
  sample ids are every sample of each epoch once, in its order. The same shrink with DDP (torch backend,
  replication_factor 1) is checked on test_shrink_grow_e2e's run that loses node 2, before that job grows back
  (the same assertions, and its final weights equal a run without rlsup through the shrink and the growth): a
  whole 3-node run fewer.
- A spare left: it takes the lost rank first, and the job never shrinks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsup_format.manifest import manifest_name, read_manifest
from rlsup_format.names import step_dir_name
from support.incidents import incidents
from support.shrink_cluster import (CONTINUED, HELD, SAVE_AT, UNTIL,
                                    ShrinkCluster, id_logs, lose, node_logs, run_until_held)
from support.spares_cluster import took_rank
from support.world_phases import Phase, check_data_order, consumed, consumed_from, run_chain, same_state


def lose_node_2_at_held(cluster: ShrinkCluster) -> dict[int, int]:
    """Run the job to HELD, lose node 2 there for good, and wait for the nodes left to end; their exit codes."""
    try:
        run_until_held(cluster)
        lose(cluster, [2])
        return cluster.wait_all(timeout=180)
    finally:
        cluster.kill_all()


def same_weights_without_rlsup(cluster: ShrinkCluster, workdir: Path, world_after: int, model: str = "ddp",
                               backend: str = "torch") -> tuple[Phase, Phase]:
    """Assert node 0's final weights equal the same job's without rlsup (3 ranks to HELD, then ``world_after``
    ranks from that save to the end), bit for bit; that reference run's phases."""
    reference = (Phase(3, HELD, tuple(s for s in SAVE_AT if s <= HELD), range(1, HELD + 1)),
                 Phase(world_after, UNTIL, tuple(s for s in SAVE_AT if s > HELD), range(HELD + 1, UNTIL + 1)))
    run_chain(workdir / "reference", reference, model, backend)
    assert same_state(cluster.node_dir(0) / "final.pt", workdir / "reference" / "final.pt") == []
    return reference


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, backend, factor", [
    # ("ddp", "torch", 1): on test_shrink_grow_e2e's run (test_a_lost_node_back_grows_the_job_at_its_next_save[2])
    # dcp reshards: every node reads every part, so each part needs a replica on a node left (factor 2 of 3)
    ("fsdp", "dcp", 2),
])
def test_a_lost_node_without_spare_shrinks_the_job_exactly(workdir: Path, model: str, backend: str,
                                                           factor: int) -> None:
    cluster = ShrinkCluster(workdir, model=model, backend=backend, replication_factor=factor)
    codes = lose_node_2_at_held(cluster)
    assert codes[0] == 0 and codes[1] == 0, (codes, node_logs(cluster))
    for node in (0, 1):
        assert CONTINUED in cluster.log(node), (node, node_logs(cluster))
    assert f"WORLD_CHANGE {HELD} 3 2" in cluster.log(0), node_logs(cluster)
    for node in (0, 1):  # the failure's incident says what the job went on with; state.json its size now
        assert [i.get("world") for i in incidents(cluster.node_dir(node) / ".rlsup")] == [CONTINUED], node
        assert (cluster.state(node)["world_nodes"], cluster.state(node)["job_nodes"]) == (2, 3)
    manifests = [read_manifest(cluster.node_dir(n) / "checkpoints" / step_dir_name(HELD) / manifest_name(n))
                 for n in (0, 1)]
    assert all(m.world_size == 3 and m.resizable for m in manifests), manifests

    # The same job without rlsup: 3 ranks to HELD, then 2 ranks from that save to the end.
    reference = same_weights_without_rlsup(cluster, workdir, 2, model, backend)
    check_data_order(consumed(workdir / "reference", reference), UNTIL)

    # The ids the ranks consumed: the first attempt's up to HELD (what it took after HELD died with it and was
    # redone), then the shrunk attempt's, every sample of each epoch once.
    logs = id_logs(cluster)
    attempts = list(logs)
    assert len(attempts) == 2 and attempts[0] == 0, {a: [str(p) for p in f] for a, f in logs.items()}
    shrunk = logs[attempts[1]]
    assert min(int(line.split()[0]) for p in shrunk for line in p.read_text().splitlines()) == HELD + 1, shrunk
    check_data_order(consumed_from([logs[0], shrunk], reference), UNTIL)


@pytest.mark.timeout(300)
def test_a_spare_takes_the_lost_rank_first_and_the_job_never_shrinks(workdir: Path) -> None:
    """3 nodes and a spare, ``min_nodes`` 2: node 2 lost at HELD, the spare takes its rank; the job goes on with 3
    nodes (nothing says it continued on fewer) and ends with the weights of a run that kept 3 ranks throughout."""
    cluster = ShrinkCluster(workdir, spares=1)
    codes = lose_node_2_at_held(cluster)
    assert codes[0] == 0 and codes[1] == 0 and codes[3] == 0, (codes, node_logs(cluster))
    assert took_rank(cluster.log(3)) == 2, node_logs(cluster)
    assert all("continued on" not in cluster.log(n) for n in (0, 1, 3)), node_logs(cluster)
    same_weights_without_rlsup(cluster, workdir, 3)
