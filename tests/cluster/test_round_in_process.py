"""The whole agreement round of several nodes in one process, in well under a second per case (issue 42).

Three simulated nodes of two ranks each (world 6), each with its own directories of real rlsup parts, run the real
round (``NodeGroup.join`` and ``agree``: inventories, node 0's plan by ``compute_plan``, fetches through
``fetch_part``, fetch results, re-plans, ready) on their own threads over one in-memory store
(tests/support/in_process_round.py, tests/support/memory_kvstore.py). A peer's replicas are read from its
directory in process instead of over HTTP; everything else is the production code. Each case asserts the plans
node 0 published and the files every node ends with:

- every node holds everything: all resume from the newest step common to all, nothing is read from anyone;
- a node lost its disks, or one of its parts rotted: its parts come back from the replica holder, bit-identical;
- the first holder of a part fails (unreachable, or its copy arrives corrupt): the next holder is used, a peer's
  copy before the persistent tier's; with no holder left the attempt ends for every node before anyone launches
  whatever order the nodes look at the store in (node 0 launched from scratch when it looked last: fixed);
- a persistent part fails verification after the plan: node 0 plans again without it, every node resumes from an
  older step, and the part already fetched for the abandoned step loses its manifest;
- the memory tier: a node whose parts are all in its tier resumes from there in place, a node that had to fetch
  resumes from its checkpoint directory with its tier's parts copied there.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Sequence

import pytest

from rlsup_format.manifest import manifest_name
from rlsup_format.names import step_dir_name
from supervisor.run.loop import AttemptAbandoned
from supervisor.tiers.holdings import PERSISTENT_HOLDER
from supervisor.tiers.parts import verify_part
from supervisor.tiers.resume import TIER_LOCAL, TIER_MEMORY, TIER_PEER, TIER_PERSISTENT
from support.files import file_stat
from support.in_process_round import JOB, Fault, NodeOutcome, Read, SimCluster, node_step_files, step_files
from support.memory_kvstore import MemoryKVStore

P = PERSISTENT_HOLDER


def resumed(outcomes: list[NodeOutcome]) -> list[tuple[int | None, str]]:
    """(step, tier) each node resumes from; a node whose round failed fails the test, naming its error."""
    for o in outcomes:
        assert o.error is None, f"node {o.node}: {o.error!r}; its log: {o.lines}"
        assert o.attempt == 0
    return [(o.resume.step, o.resume.tier) if o.resume is not None else (None, "") for o in outcomes]


def reads_of(step: int, *holders_and_ranks: tuple[int | str, int]) -> list[Read]:
    """Node 2's reads of ``step``, one data file per (holder, rank), in order."""
    return [Read(h, 2, step, f"rank_{r:05d}.pt") for h, r in holders_and_ranks]


def two_steps(tmp_path: Path, factor: int = 1, **tiers: bool) -> SimCluster:
    """Steps 10 and 20 saved by every node and replicated ``factor`` times."""
    cluster = SimCluster(tmp_path, **tiers)
    for step in (10, 20):
        cluster.save(step)
        cluster.replicate(step, factor)
    return cluster


def test_every_node_holds_everything_so_all_resume_from_the_newest_common_step_and_nothing_moves(
        tmp_path: Path) -> None:
    """Nodes 0 and 1 also saved (and replicated) step 30, node 2 did not reach it: step 30 is whole nowhere, so
    step 20, in place on every node: no fetch, no file read from a holder, no file rewritten."""
    cluster = two_steps(tmp_path)
    cluster.save(30, nodes=[0, 1])
    cluster.replicate(30, nodes=[0, 1])
    before = {(n.rank, p.name): file_stat(p) for n in cluster.nodes for p in (n.ckpt / step_dir_name(20)).iterdir()}
    outcomes = cluster.round()
    assert resumed(outcomes) == [(20, TIER_LOCAL)] * 3
    assert [o.resume.path for o in outcomes] == [n.ckpt / step_dir_name(20) for n in cluster.nodes]  # type: ignore[union-attr]
    (plan,) = cluster.plans(0)
    assert (plan.step, plan.world_size, plan.fetch) == (20, 6, {})
    assert cluster.reads == []
    assert {(n.rank, p.name): file_stat(p) for n in cluster.nodes
            for p in (n.ckpt / step_dir_name(20)).iterdir()} == before


@pytest.mark.parametrize("loss", ["wiped", "rotted"])
def test_a_nodes_lost_parts_come_back_from_the_replica_holder_bit_identical(tmp_path: Path, loss: str) -> None:
    """Node 2's parts are replicated on node 0 (replication_factor 1). ``wiped``: node 2 comes back with empty disks;
    ``rotted``: one byte of its rank 5 part of step 20 changed on its disk (its inventory verifies every checksum,
    so the part is not offered). Either way every node resumes from step 20, node 2 with the holder's copies."""
    cluster = two_steps(tmp_path)
    node2 = cluster.nodes[2]
    saved = node_step_files(node2, 20)
    if loss == "wiped":
        node2.wipe()
    else:
        path = node2.ckpt / step_dir_name(20) / "rank_00005.pt"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    outcomes = cluster.round()
    assert resumed(outcomes) == [(20, TIER_LOCAL), (20, TIER_LOCAL), (20, TIER_PEER)]
    (plan,) = cluster.plans(0)
    lost = [4, 5] if loss == "wiped" else [5]
    assert (plan.step, plan.fetch) == (20, {2: {r: [0] for r in lost}})
    assert cluster.reads == reads_of(20, *[(0, r) for r in lost])
    assert node_step_files(node2, 20) == saved
    assert outcomes[2].resume.path == node2.ckpt / step_dir_name(20)  # type: ignore[union-attr]


@pytest.mark.parametrize("fault", [Fault.UNREACHABLE, Fault.CORRUPT])
def test_the_next_holder_is_used_when_the_first_fails(tmp_path: Path, fault: Fault) -> None:
    """Replication factor 2: node 2's parts are on nodes 0 and 1. Node 2 comes back empty; node 0's copy fails as it
    is fetched (unreachable, or its bytes arrive changed, which the checksum computed as they pass catches). Each
    part comes from node 1 instead, bit-identical, and nothing of the bad copy stays."""
    cluster = two_steps(tmp_path, factor=2)
    node2 = cluster.nodes[2]
    saved = node_step_files(node2, 20)
    node2.wipe()
    cluster.faults[(0, 2)] = fault
    outcomes = cluster.round()
    assert resumed(outcomes) == [(20, TIER_LOCAL), (20, TIER_LOCAL), (20, TIER_PEER)]
    (plan,) = cluster.plans(0)
    assert plan.fetch == {2: {4: [0, 1], 5: [0, 1]}}
    assert cluster.reads == reads_of(20, (0, 4), (1, 4), (0, 5), (1, 5))  # each part: node 0 first, then node 1
    assert node_step_files(node2, 20) == saved
    assert [p.name for p in (node2.ckpt / step_dir_name(20)).iterdir() if p.name.startswith(".")] == []


def test_a_peer_that_fails_is_followed_by_the_persistent_tier(tmp_path: Path) -> None:
    """Node 2's replication of step 20 lagged: only its rank 4 part reached node 0; the persistent tier holds the
    whole step. Node 2 comes back empty. The nodes' own parts reach only step 10; node 0 plans step 20 with the tier
    as the last holder: rank 4 from node 0 (unreachable now), then the tier; rank 5 from the tier alone."""
    cluster = SimCluster(tmp_path, persistent=True)
    cluster.save(10)
    cluster.replicate(10)
    cluster.save(20)
    cluster.replicate(20, nodes=[0, 1])
    cluster.replicate(20, nodes=[2], ranks=[4])
    cluster.persist(20)
    node2 = cluster.nodes[2]
    saved = node_step_files(node2, 20)
    node2.wipe()
    cluster.faults[(0, 2)] = Fault.UNREACHABLE
    outcomes = cluster.round()
    assert resumed(outcomes) == [(20, TIER_LOCAL), (20, TIER_LOCAL), (20, TIER_PERSISTENT)]
    (plan,) = cluster.plans(0)
    assert (plan.step, plan.fetch) == (20, {2: {4: [0, P], 5: [P]}})
    assert cluster.reads == reads_of(20, (0, 4), ("persistent", 4), ("persistent", 5))
    assert node_step_files(node2, 20) == saved


def test_no_holder_left_ends_the_attempt_for_every_node_before_launch(tmp_path: Path) -> None:
    """Node 2's only holder (node 0) is unreachable: node 2's fetch fails, the attempt ends for all (the next
    attempt plans from fresh inventories), and no node gets a resume point for this one."""
    cluster = two_steps(tmp_path)
    cluster.nodes[2].wipe()
    cluster.faults[(0, 2)] = Fault.UNREACHABLE
    outcomes = cluster.round()
    for o in outcomes:
        assert isinstance(o.error, AttemptAbandoned), (o.node, o.error)
        assert "fetch failed" in str(o.error) and "could not fetch step 20 rank 4" in str(o.error), (o.node, o.error)
    assert cluster.store.keys(f"rlsup/{JOB.id}/end/") == [f"rlsup/{JOB.id}/end/0"]
    assert cluster.store.keys(f"rlsup/{JOB.id}/ready/0/all") == []  # nobody was told to launch
    assert cluster.reads == reads_of(20, (0, 4))  # rank 5 is not tried once rank 4 failed


def node_0_looks_late(store: MemoryKVStore, keys: Sequence[str]) -> None:
    """A legal order of the nodes' looks at the store (a node 0 descheduled, a store poll slow): node 0 reads the
    fetch results once all three are in, the other nodes read node 0's summary once it is written, and node 0 reads
    the ready marks once nodes 1 and 2 have marked ready."""
    def key(name: str) -> str:
        return f"rlsup/{JOB.id}/{name}"
    if key("fetched/0/0/0") in keys:
        store.wait_until_written([key(f"fetched/0/0/{n}") for n in range(3)], 5.0)
    elif key("fetched/0/0/all") in keys:
        store.wait_until_written([key("fetched/0/0/all")], 5.0)
    elif key("ready/0/1") in keys:
        store.wait_until_written([key("ready/0/1"), key("ready/0/2")], 5.0)


def test_a_fetch_failure_ends_the_attempt_on_node_0_whatever_order_the_nodes_look_in(tmp_path: Path) -> None:
    """As the case above, with the nodes' looks ordered by :func:`node_0_looks_late`: every node must still abandon
    the attempt (none may launch, least of all from scratch over its checkpoints: with a memory tier the launch
    supersedes every step newer than "none")."""
    cluster = SimCluster(tmp_path, store=MemoryKVStore(tmp_path.name, before_poll=node_0_looks_late))
    for step in (10, 20):
        cluster.save(step)
        cluster.replicate(step)
    cluster.nodes[2].wipe()
    cluster.faults[(0, 2)] = Fault.UNREACHABLE
    outcomes = cluster.round()
    assert [type(o.error) for o in outcomes] == [AttemptAbandoned] * 3, [(o.node, o.resume, o.error) for o in outcomes]
    assert cluster.store.keys(f"rlsup/{JOB.id}/ready/0/all") == []


def test_a_persistent_part_that_fails_verification_makes_node_0_plan_an_older_step(tmp_path: Path) -> None:
    """Node 2 comes back empty; its step 20 was never replicated, only persisted, and the tier's copy of rank 5
    has a changed byte (its size is right, so the tier's listing offers it). Try 0 plans step 20 with node 2
    fetching from the tier: rank 4 arrives, rank 5 does not verify. Node 0 plans again without the bad part: step
    10, whose node 2 parts node 0 holds. Every node resumes from step 10; node 2's rank 4 part of step 20, fetched
    for the abandoned plan, lost its manifest (the trainer rewrites it at step 20)."""
    cluster = SimCluster(tmp_path, persistent=True)
    cluster.save(10)
    cluster.replicate(10)
    cluster.save(20)
    cluster.replicate(20, nodes=[0, 1])
    cluster.persist(20)
    tier_copy = cluster.persistent_dir / step_dir_name(20) / "rank_00005.pt"
    data = bytearray(tier_copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tier_copy.write_bytes(bytes(data))
    node2 = cluster.nodes[2]
    saved = node_step_files(node2, 10)
    node2.wipe()
    outcomes = cluster.round()
    assert resumed(outcomes) == [(10, TIER_LOCAL), (10, TIER_LOCAL), (10, TIER_PEER)]
    first, second = cluster.plans(0)
    assert (first.step, first.fetch) == (20, {2: {4: [P], 5: [P]}})
    assert (second.step, second.fetch) == (10, {2: {4: [0], 5: [0]}})
    assert cluster.reads == [*reads_of(20, ("persistent", 4), ("persistent", 5)), *reads_of(10, (0, 4), (0, 5))]
    assert node_step_files(node2, 10) == saved
    step20 = node2.ckpt / step_dir_name(20)
    assert (step20 / "rank_00004.pt").exists() and not (step20 / manifest_name(4)).exists()
    assert any("planning again without them" in line for line in outcomes[2].lines), outcomes[2].lines
    for node in cluster.nodes[:2]:  # the nodes' own newer step is left as it is (the launch supersedes it)
        assert all(verify_part(node.ckpt / step_dir_name(20), r) is not None for r in cluster.ranks_of(node.rank))


def test_nodes_whose_parts_are_all_in_memory_resume_there_in_place(tmp_path: Path) -> None:
    """Step 30 is in every node's memory tier, drained to disk and replicated (step 20 only on disk). Node 2 comes
    back with empty disks and an empty tier: it fetches step 30 from node 0 and resumes from its checkpoint
    directory; nodes 0 and 1 resume from their memory tiers, in place, and nothing of step 30 is copied to disk."""
    cluster = two_steps(tmp_path, memory=True)
    cluster.save(30, memory=True)
    for node in cluster.nodes:
        assert node.memory is not None and node.memory.copy_to_disk(30) == 2  # the drain
    cluster.replicate(30)
    node2 = cluster.nodes[2]
    saved = node_step_files(node2, 30)
    node2.wipe()
    on_disk = {n.rank: node_step_files(n, 30) for n in cluster.nodes[:2]}
    outcomes = cluster.round()
    assert resumed(outcomes) == [(30, TIER_MEMORY), (30, TIER_MEMORY), (30, TIER_PEER)]
    (plan,) = cluster.plans(0)
    assert (plan.step, plan.fetch) == (30, {2: {4: [0], 5: [0]}})
    for node, outcome in zip(cluster.nodes[:2], outcomes):
        assert node.memory is not None and outcome.resume is not None
        assert outcome.resume.path == node.memory.root / step_dir_name(30)
        assert node_step_files(node, 30) == on_disk[node.rank]
    assert outcomes[2].resume.path == node2.ckpt / step_dir_name(30)  # type: ignore[union-attr]
    assert node_step_files(node2, 30) == saved


def test_a_node_that_fetched_resumes_from_disk_with_its_memory_parts_copied_there(tmp_path: Path) -> None:
    """Node 1's memory tier holds its rank 2 part of step 30, and a torn rank 3 part (no manifest: the rank died
    saving it); its disk lost step 30, which node 2 holds as a replica. The plan has node 1 fetch rank 3 from
    node 2; node 1 then cannot load step 30 from memory in place, so its tier's rank 2 part is copied beside the
    fetched one in its checkpoint directory, and it resumes from there."""
    cluster = SimCluster(tmp_path, memory=True)
    cluster.save(30, memory=True)
    node1 = cluster.nodes[1]
    assert node1.memory is not None and node1.memory.copy_to_disk(30) == 2
    cluster.replicate(30, nodes=[1])
    held = step_files(node1.memory.root / step_dir_name(30))
    shutil.rmtree(node1.ckpt / step_dir_name(30))
    (node1.memory.root / step_dir_name(30) / manifest_name(3)).unlink()
    outcomes = cluster.round()
    assert resumed(outcomes) == [(30, TIER_MEMORY), (30, TIER_PEER), (30, TIER_MEMORY)]
    (plan,) = cluster.plans(0)
    assert (plan.step, plan.fetch) == (30, {1: {3: [2]}})
    assert outcomes[1].resume.path == node1.ckpt / step_dir_name(30)  # type: ignore[union-attr]
    assert node_step_files(node1, 30) == held  # ranks 2 (from memory) and 3 (from node 2), bit-identical
    assert cluster.reads == [Read(2, 1, 30, "rank_00003.pt")]
    assert any("1 part(s) copied from the memory tier" in line for line in outcomes[1].lines), outcomes[1].lines


def test_an_attempt_ended_before_its_plan_is_skipped_by_every_node_s_next_join(tmp_path: Path) -> None:
    """Attempt 1 ended in its round before any plan (a node stopped there, or its lead was gone): the nodes in it
    abandon it, and every node's next join goes past it to attempt 2, which runs (it used to join attempt 1 again,
    ended, for ever)."""
    cluster = SimCluster(tmp_path)
    cluster.save(10)
    cluster.replicate(10)
    assert all(o.error is None for o in cluster.round())
    store = cluster.groups[1].coordinator
    store.end(0, "node 1: its ranks failed")
    store.end(1, "node 2: asked to stop while waiting for the inventories of attempt 1")
    outcomes = cluster.round()
    assert [(o.attempt, o.error, o.resume.step if o.resume else None) for o in outcomes] == [(2, None, 10)] * 3
