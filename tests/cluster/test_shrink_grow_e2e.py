"""Shrink (issue 43), the other half: growing back, and when the job does not shrink
(:mod:`support.shrink_cluster`).

- A lost node back (empty disk) waits without ending the running attempt; the job grows back to 3 nodes at its
  next save, with the weights of a run without rlsup that went 3 -> 2 -> 3 ranks at the same steps. Node 2, and node
  0 in a store that outlives it (etcd: node 1 or 2 leads the rounds meanwhile, torchrun's master on node 1).
  Before it grows, the same run checks the shrink itself (DDP, torch backend, replication factor 1; the case
  test_shrink_e2e ran on a run of its own): the nodes left say (log and incident) they continued on 2 of 3 nodes
  from HELD, state.json says 2 of 3, rank 0 restored HELD (saved by 3 ranks, marked resizable) into 2 ranks, and
  the shrunk attempt took its first step at HELD + 1. A shrunk job that runs to its end: test_shrink_e2e (FSDP2).
- Below the floor (nodes 1 and 2 lost): node 0 waits ``rendezvous_timeout`` and exits 75 for a requeue, its
  checkpoints and replicas untouched.
- Saves never marked resizable: nodes 0 and 1 never continue on 2 nodes; node 0 (which plans the rounds) says once
  that the checkpoints cannot be restored into another world size, and both exit 75 after ``rendezvous_timeout``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

import pytest

from rlsup_format.manifest import manifest_name, read_manifest
from rlsup_format.names import step_dir_name
from support.incidents import incidents
from support.shrink_cluster import (CONTINUED, GROW_AT, HELD, NODES, NOT_RESIZABLE, RENDEZVOUS_S, REQUEUE, SAVE_AT, UNTIL,
                                    ShrinkCluster, assert_parts_untouched, id_logs, lose, node_logs, parts,
                                    run_until_held)
from support.waits import wait_for
from etcd_cluster import EtcdCluster, etcd_cluster  # noqa: F401 - the fixture, for node 0's case
from support.world_phases import Phase, check_data_order, consumed, consumed_from, run_chain, same_state


#: The run without rlsup both growth cases compare with: 3 ranks to HELD, 2 ranks to GROW_AT, 3 ranks to the end.
GROWN = (Phase(3, HELD, tuple(s for s in SAVE_AT if s <= HELD), range(1, HELD + 1)),
         Phase(2, GROW_AT, (GROW_AT,), range(HELD + 1, GROW_AT + 1)),
         Phase(3, UNTIL, (), range(GROW_AT + 1, UNTIL + 1)))


@pytest.fixture(scope="module")
def grown_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Path]:
    """GROWN's final weights, run once for the module's cases (whichever first gets that far; again after a run
    that failed part way): both cases shrink and grow at the same steps, so they compare with the same run."""
    root = tmp_path_factory.mktemp("grown-reference") / "run"

    def final() -> Path:
        if not (root / "final.pt").exists():
            shutil.rmtree(root, ignore_errors=True)
            run_chain(root, GROWN, "ddp", "torch")
        return root / "final.pt"
    return final


def said_continued(cluster: ShrinkCluster, node: int) -> bool:
    """Node ``node`` said, in its log and in its one incident (the loss), that the job continued on 2 of 3 nodes."""
    return CONTINUED in cluster.log(node) and \
        [i.get("world") for i in incidents(cluster.node_dir(node) / ".rlsup")] == [CONTINUED]


def assert_shrunk_while_held(cluster: ShrinkCluster, left: list[int]) -> None:
    """What the shrink leaves, checked while the shrunk job holds (before the lost node is back): each node left
    says (log, and the failure's incident) it continued on 2 of 3 nodes from HELD and its state.json says 2 of 3;
    HELD was saved by 3 ranks and marked resizable; rank 0 of the shrunk job restored it into 2 ranks."""
    for node in left:
        wait_for(lambda: said_continued(cluster, node), 30, f"node {node} saying (log and incident) it continued",
                 interval=0.5)
        assert (cluster.state(node)["world_nodes"], cluster.state(node)["job_nodes"]) == (2, 3), node
        manifest = read_manifest(cluster.node_dir(node) / "checkpoints" / step_dir_name(HELD) / manifest_name(node))
        assert manifest.world_size == 3 and manifest.resizable, manifest
    assert any(f"WORLD_CHANGE {HELD} 3 2" in cluster.log(n) for n in left), node_logs(cluster)


def assert_grown_as_without_rlsup(cluster: ShrinkCluster, reference: Path) -> None:
    """Node 0's final weights equal GROWN's (run without rlsup); over the kept steps of the 3 attempts the ranks
    consumed every sample of each epoch once, in its order (GROWN's ranks too); the shrunk attempt started at
    HELD + 1 (what the first attempt took after HELD died with it and was redone)."""
    assert same_state(cluster.node_dir(0) / "final.pt", reference) == []
    check_data_order(consumed(reference.parent, GROWN), UNTIL)
    logs = id_logs(cluster)
    assert len(logs) == 3, {a: [str(p) for p in f] for a, f in logs.items()}
    shrunk = list(logs.values())[1]
    assert min(int(line.split()[0]) for p in shrunk for line in p.read_text().splitlines()) == HELD + 1, shrunk
    check_data_order(consumed_from(list(logs.values()), GROWN), UNTIL)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("lost", [2, 0])
def test_a_lost_node_back_grows_the_job_at_its_next_save(workdir: Path, lost: int, request: pytest.FixtureRequest,
                                                          grown_reference: Callable[[], Path]) -> None:
    """Node ``lost`` lost at HELD, the job goes on with 2 nodes and holds after its first step; the node comes back
    with an empty disk and waits (its return does not end the running attempt); the job, released, saves at GROW_AT
    and the next round grows it back to 3 nodes from there. The final weights equal a run without rlsup with the same
    shrink and grow points (3 ranks to HELD, 2 ranks to GROW_AT, 3 ranks to the end), and the ids of the kept steps
    are every sample of each epoch once. Node 0 lost: the job's store is etcd (the embedded one goes with node 0).
    While the shrunk job holds: :func:`assert_shrunk_while_held` (test_shrink_e2e's DDP case, merged here)."""
    released = workdir / "release-shrunk"
    store: list[str] = []
    if lost == 0:
        etcd: EtcdCluster = request.getfixturevalue("etcd_cluster")
        store = ["--coordinator-backend", "etcd", "--coordinator-endpoints", ",".join(etcd.endpoints)]
    left = [n for n in range(NODES) if n != lost]
    # the shrunk job also holds after its save at GROW_AT (for good: the lead ends that attempt to grow), so it cannot
    # finish before the lead's look (a second here; this job's steps take milliseconds)
    cluster = ShrinkCluster(workdir, job_args=["--hold-in", f"2:{HELD + 1}:{released}", "--hold-in",
                                               f"2:{GROW_AT}:{workdir / 'never'}"],
                            extra=["--max-restarts", "1", *store])  # the loss uses it up: growing back must not count
    try:
        run_until_held(cluster)
        lose(cluster, [lost])
        wait_for(lambda: f"HOLDING in world 2 after step {HELD + 1}" in cluster.log(left[0]), 180,
                 "the shrunk job holding", interval=0.5)
        assert_shrunk_while_held(cluster, left)
        cluster.start(lost)  # back, its disk empty
        wait_for(lambda: "waiting for its next save to grow back" in cluster.log(lost), 120,
                 f"node {lost} waiting to grow")
        wait_for(lambda: any(f"node(s) [{lost}] back" in cluster.log(n) for n in left), 30,
                 f"the lead to see node {lost} back")
        assert all("grew back" not in cluster.log(n) for n in range(NODES)), node_logs(cluster)
        released.touch()
        codes = cluster.wait_all(timeout=240)
    finally:
        cluster.kill_all()
    assert codes == {0: 0, 1: 0, 2: 0}, (codes, node_logs(cluster))
    if lost == 0:  # one of the nodes left led the round without node 0, and said so
        assert sum(cluster.log(n).count("attempt 1: node 0 is missing from the round") for n in left) == 1, \
            node_logs(cluster)
    for node in range(NODES):
        assert f"grew back to 3 at step {GROW_AT}" in cluster.log(node), (node, node_logs(cluster))
    assert [i.get("world") for i in incidents(cluster.node_dir(left[0]) / ".rlsup")] == [
        CONTINUED, f"grew back to 3 at step {GROW_AT}"]
    for node in range(NODES):  # the grow-back end is nobody's failure, on the nodes that ran it and the one waiting
        assert [(i["reason"], i["action"]) for i in incidents(cluster.node_dir(node) / ".rlsup")][-1] == \
            ("resized", "restart"), (node, node_logs(cluster))
    assert cluster.state(left[0])["world_nodes"] == 3
    assert_grown_as_without_rlsup(cluster, grown_reference())


@pytest.mark.timeout(300)
def test_below_the_floor_the_node_left_requeues_and_deletes_nothing(workdir: Path) -> None:
    cluster = ShrinkCluster(workdir, rendezvous_timeout=RENDEZVOUS_S)
    try:
        run_until_held(cluster)
        before = parts(cluster.node_dir(0))
        lost_at = lose(cluster, [1, 2])
        codes = cluster.wait_all(timeout=RENDEZVOUS_S + 120)
        waited = time.monotonic() - lost_at
    finally:
        cluster.kill_all()
    assert codes[0] == REQUEUE, (codes, node_logs(cluster))
    assert waited >= RENDEZVOUS_S - 1, f"node 0 gave up {waited:.1f}s after the loss: {node_logs(cluster)}"
    assert "continued on" not in cluster.log(0), node_logs(cluster)
    assert_parts_untouched(cluster.node_dir(0), before)


@pytest.mark.timeout(300)
def test_saves_never_marked_resizable_are_never_shrunk(workdir: Path) -> None:
    cluster = ShrinkCluster(workdir, job_args=["--not-resizable"], rendezvous_timeout=RENDEZVOUS_S)
    try:
        run_until_held(cluster)
        before = {n: parts(cluster.node_dir(n)) for n in (0, 1)}
        lost_at = lose(cluster, [2])
        codes = cluster.wait_all(timeout=RENDEZVOUS_S + 120)
        waited = time.monotonic() - lost_at
    finally:
        cluster.kill_all()
    manifest = read_manifest(cluster.node_dir(0) / "checkpoints" / step_dir_name(HELD) / manifest_name(0))
    assert manifest.world_size == 3 and not manifest.resizable, manifest
    assert codes[0] == REQUEUE and codes[1] == REQUEUE, (codes, node_logs(cluster))
    assert waited >= RENDEZVOUS_S - 1, f"the nodes gave up {waited:.1f}s after the loss: {node_logs(cluster)}"
    said = {node: len(NOT_RESIZABLE.findall(cluster.log(node))) for node in (0, 1)}
    assert said[0] == 1 and said[1] <= 1, (said, node_logs(cluster))  # node 0 plans the rounds: it knows why
    for node in (0, 1):
        log = cluster.log(node)
        assert "continued on" not in log and "WORLD_CHANGE" not in log, (node, node_logs(cluster))
        assert_parts_untouched(cluster.node_dir(node), before[node])
    assert list(id_logs(cluster)) == [0], "an attempt after the loss took a step"
