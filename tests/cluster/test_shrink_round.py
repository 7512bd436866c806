"""Out of spares, the job goes on with fewer nodes (issue 43): the agreement round on a smaller world and back, in
process (:mod:`support.in_process_round`: real parts written by trainer_hooks' writer, real inventories, the real
lead and plans, real copies), and the lead's rule for when it may shrink (with a recording store).

What the round must do: with ``min_nodes`` 2 and node 2 lost, nodes 0 and 1 plan the newest step complete on them
(node 2's parts from the replicas they keep), each gets the parts its new ranks read (rank 0's, for the torch
backend), and each launches as node i of 2 with the saving world's size in its environment; never for saves that
are not marked resizable, with a spare left, or below the floor. Node 2 back: it waits (the attempt is not ended
by its return), the lead ends the attempt at its next save, and the next round grows the job back.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from rlsup_format import job_env
from rlsup_format.manifest import manifest_name
from rlsup_format.names import step_dir_name
from supervisor.cluster import grow_back
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.endpoint_probe import MIN_REFUSALS, EndpointProbe, connect_refused
from supervisor.cluster.round_lead import RoundLead, ShrinkSettings
from supervisor.cluster.spares import JobEnded
from supervisor.cluster.round_plan import compute_resized_plan, saved_by
from supervisor.lifecycle import EndReason
from supervisor.run.loop import AttemptAbandoned
from supervisor.run.peers import World
from supervisor.tiers.holdings import NodeInventory, RecordError, RoundPlan, StepHoldings
from supervisor.tiers.parts import verify_part
from supervisor.tiers.resume import TIER_LOCAL
from support.in_process_round import JOB, SECRET, SimCluster
from support.memory_kvstore import MemoryKVStore
from support.ports import free_port
from support.waits import wait_for


@pytest.fixture(autouse=True)
def _quick_grow_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A left-out node looks for the attempt's end every GROW_POLL_S (1 s): a tenth of that here, where the store is
    in memory, so that a fast test does not sit out whole polls (what is looked at, and when, is unchanged)."""
    from supervisor.cluster import multinode

    monkeypatch.setattr(multinode, "GROW_POLL_S", 0.1)

SHRINK = ShrinkSettings(min_nodes=2, wait_s=0.2)
PINNED = ["torchrun", "--nproc-per-node", "2", "--nnodes", "3", "--node-rank", "1", "--rdzv-backend", "static",
          "--master-addr", "127.0.0.1", "--master-port", "29500", "train.py", "--nnodes", "7"]


def shrunk_cluster(tmp: Path, resizable: bool = True) -> SimCluster:
    """3 nodes of 2 ranks ran attempt 0 together, saved steps 10 and 20 (replicated on the ring), then node 2 was
    lost with its disk."""
    cluster = SimCluster(tmp, shrink=SHRINK)
    for step in (10, 20):
        cluster.save(step, resizable=resizable)
        cluster.replicate(step)
    first = cluster.round()
    assert all(o.error is None for o in first), first
    cluster.nodes[2].wipe()
    cluster.groups.pop(2)  # lost: a later node 2 is a new supervisor
    return cluster


def test_two_of_three_nodes_go_on_from_the_newest_complete_step_with_rank_0_s_part_on_each(tmp_path: Path) -> None:
    cluster = shrunk_cluster(tmp_path)
    outcomes = cluster.round(nodes=[0, 1])
    assert [(o.error, o.resume.step if o.resume else None) for o in outcomes] == [(None, 20), (None, 20)], outcomes
    plan = cluster.plans(1)[0]
    assert (plan.nodes, plan.world_size, plan.from_nodes, plan.step) == ((0, 1), 6, 3, 20)
    assert plan.fetch == {1: {0: [1]}} and plan.owners == {0: 0}  # node 1 copies rank 0's part from its own replica
    step20 = cluster.nodes[1].ckpt / step_dir_name(20)
    assert verify_part(step20, 0) is not None  # rank 0's part, whole, beside node 1's own
    for o in outcomes:
        assert any("continued on 2 of 3 nodes from step 20" in line for line in o.lines), o.lines
    assert [cluster.groups[n].world() for n in (0, 1)] == [World(2, 3, "continued on 2 of 3 nodes from step 20")] * 2
    for node, group in ((n, cluster.groups[n]) for n in (0, 1)):
        env = group.env()
        assert (env[job_env.NODE_RANK], env[job_env.NUM_NODES], env[job_env.PREVIOUS_WORLD_SIZE]) == (str(node), "2", "6")
        assert group.command(PINNED)[4:7] == ["2", "--node-rank", str(node)]
        assert group.command(PINNED)[-2:] == ["--nnodes", "7"]  # the script's own argument is left alone


class Store:
    """The lead's view of the store: inventories that came within the shrink's wait, then every node's."""

    first_round = False

    def __init__(self, came: dict[int, NodeInventory], every: list[NodeInventory]) -> None:
        self.came, self.every, self.num_nodes = came, every, len(every)
        self.asked: list[str] = []

    def present_inventories(self, attempt: int, after_s: float, floor: int,
                            gone: Callable[[int], bool] = lambda node: False) -> dict[int, NodeInventory]:
        self.asked.append(f"present {after_s} {floor}")
        return self.came

    def inventories(self, attempt: int) -> list[NodeInventory]:
        self.asked.append("every")
        return self.every


def inventories(resize: str = "rank0") -> list[NodeInventory]:
    """Step 20 of 3 nodes x 1 rank, each part replicated on the next node (the ring)."""
    return [NodeInventory(n, {20: StepHoldings(3, {n: n}, {(n - 1) % 3: (n - 1) % 3}, resize)})  # type: ignore[arg-type]
            for n in range(3)]


@pytest.mark.parametrize("why, shrink, spares, came, resize", [
    ("below the floor", ShrinkSettings(2, 0.1), 0, [0], "rank0"),
    ("not resizable", ShrinkSettings(2, 0.1), 0, [0, 1], ""),
    # a trainer without trainer_hooks (or a layout rlsup only reads): no rlsup part of any step in the inventories
    ("no rlsup checkpoint", ShrinkSettings(2, 0.1), 0, [0, 1], None),
    ("a spare is left", ShrinkSettings(2, 0.1), 1, [0, 1], "rank0"),
    ("min_nodes is the job's size", ShrinkSettings(3, 0.1), 0, [0, 1], "rank0"),
    ("min_nodes unset", ShrinkSettings(0, 0.1), 0, [0, 1], "rank0"),
])
def test_the_lead_plans_every_node_when_it_may_not_shrink(why: str, shrink: ShrinkSettings, spares: int,
                                                           came: list[int], resize: str | None) -> None:
    """Below the floor and for saves not marked resizable it asked who came, and waits for every node (saying why
    once); with a spare left or no floor below the job's size it never asks."""
    every = inventories(resize) if resize is not None else [NodeInventory(n) for n in range(3)]
    store = Store({n: every[n] for n in came}, every)
    said: list[str] = []
    lead = RoundLead(store, None, said.append, shrink, lambda: spares)  # type: ignore[arg-type]
    lead._ran_whole = True  # this run had an attempt of every node (before it, no node is missed)
    plan = lead.plan(4, set())
    assert plan.nodes is None and plan.step == (20 if resize is not None else None), why
    if why in ("below the floor", "not resizable", "no rlsup checkpoint"):
        assert store.asked == ["present 0.1 2", "every"]  # it asked, and then waits for all
        assert len(said) == 1 and "not going on with" in said[0], said
        if why == "not resizable":
            assert "not saved as restorable into another world size" in said[0]
    else:
        assert store.asked == ["every"] and not said, why


def test_a_run_that_has_not_yet_run_every_node_never_shrinks() -> None:
    """A requeued run (its store's keys kept, etcd): nodes that start seconds apart are not lost; the first round of
    this run waits for every node, as without min_nodes."""
    every = inventories()
    store = Store({0: every[0], 1: every[1]}, every)
    lead = RoundLead(store, None, lambda line: None, SHRINK, lambda: 0)  # type: ignore[arg-type]
    whole = lead.plan(4, set())
    assert whole.nodes is None and store.asked == ["every"]
    store.asked.clear()
    assert lead.plan(5, set()).nodes is None and store.asked == ["every"]  # planned, not yet launched
    lead.launched(whole)  # every node ran attempt 4
    store.asked.clear()
    assert lead.plan(6, set()).nodes == (0, 1) and store.asked == ["present 0.2 2"]  # now it may


def test_a_node_waiting_to_grow_back_gives_up_on_a_store_gone_without_the_job_s_end(tmp_path: Path) -> None:
    """Node 2, back and waiting for the smaller world's next save, watches for the job's end record (a job that may
    finish without it): the store gone with node 0 and no record of the end, it waits rendezvous_timeout and then
    leaves the attempt (the next join waits for the store and exits for a requeue), never waiting for ever."""
    cluster = shrunk_cluster(tmp_path)
    assert all(o.error is None for o in cluster.round(nodes=[0, 1]))
    back = cluster.group(2, timeout_s=1.0, job_end=True)
    got: dict[str, object] = {}

    def rejoin() -> None:
        try:
            back.agree(back.join(0), lambda: None)
        except BaseException as e:
            got["error"] = e
    t = threading.Thread(target=rejoin, daemon=True)
    t.start()
    wait_for(lambda: grow_back.back(back.coordinator, 1, [2]) == [2], 10, "node 2's mark that it is back")
    cluster.store.gone = True
    t.join(30)
    error = got.get("error")
    assert isinstance(error, AttemptAbandoned) and error.reason == EndReason.PEER_FAILURE, got
    assert "stayed unreachable for 1s while waiting to grow back into attempt 1" in str(error), error


def test_a_grow_back_end_is_told_apart_from_a_failure_only_when_it_won() -> None:
    """Every node reads an attempt's end as ``resized`` only when the end that won is node 0's end to grow back: a
    failure's end written first stays a failure though the grow's mark follows; a retried grow keeps its first
    words (a reply lost after the end was written never turns the grow into a failure)."""
    store = MemoryKVStore()
    lead, member = (RoundCoordinator(store, JOB, SECRET, n, 3, 60.0) for n in (0, 1))
    member.end(1, "node 1: exit_code 1")
    assert lead.end_to_resize(1, "node 0: grow back at step 30") == "node 1: exit_code 1"
    assert member.ending(1) == ("node 1: exit_code 1", EndReason.PEER_FAILURE)
    assert lead.end_to_resize(2, "node 0: grow back at step 30") == "node 0: grow back at step 30"
    assert lead.end_to_resize(2, "node 0: grow back at step 40") == "node 0: grow back at step 30"
    assert member.ending(2) == ("node 0: grow back at step 30", EndReason.RESIZED)
    assert member.ending(3) is None


def test_a_success_and_a_grow_back_at_the_job_s_last_save_race_for_the_attempt_s_one_end() -> None:
    """At the job's last save the lead may start a grow back while a node's ranks finish: whichever claimed the
    attempt's end first is what every node reads, the grow's words or the success's."""
    store = MemoryKVStore()
    lead, member = (RoundCoordinator(store, JOB, SECRET, n, 3, 60.0) for n in (0, 1))
    assert member.end_succeeded(4, "node 1: its ranks finished") == "node 1: its ranks finished"
    assert lead.end_to_resize(4, "node 0: grow back at step 36") == "node 1: its ranks finished"
    assert lead.ending(4) == member.ending(4) == ("node 1: its ranks finished", EndReason.SUCCESS)
    assert lead.end_to_resize(5, "node 0: grow back at step 36") == "node 0: grow back at step 36"
    assert member.end_succeeded(5, "node 1: its ranks finished") == "node 0: grow back at step 36"
    assert lead.end_succeeded(5, "node 0: its ranks finished") == "node 0: grow back at step 36"
    assert member.ending(5) == ("node 0: grow back at step 36", EndReason.RESIZED)


def test_every_missing_node_is_probed_in_each_look() -> None:
    """With two nodes missing, each look asks about both (their probes run side by side), and the wait ends once
    both are gone: not one node per look."""
    store = MemoryKVStore()
    coordinators = [RoundCoordinator(store, JOB, SECRET, n, 4, 60.0) for n in range(4)]
    coordinators[0].first_round = False
    for node in (0, 1):
        coordinators[node].publish_inventory(4, NodeInventory(node))
    asked: list[int] = []

    def gone(node: int) -> bool:  # each node is judged gone from its second probe on
        asked.append(node)
        return asked.count(node) > 1
    came = coordinators[0].present_inventories(4, 3600.0, 2, gone)
    assert sorted(came) == [0, 1] and asked == [2, 3, 2, 3], asked


def test_the_shrink_wait_ends_once_the_missing_node_s_endpoint_refuses_and_a_listening_one_is_waited_for() -> None:
    """The lead's wait for a missing node (``spare_takeover_s``, an hour here) ends once its replication endpoint
    refuses connects (its rlsup is gone: the spare's rule, supervisor.cluster.endpoint_probe); a node whose endpoint
    still listens (a hung or slow rlsup) is waited for, and plans with every node once it comes."""
    store = MemoryKVStore()
    coordinators = [RoundCoordinator(store, JOB, SECRET, n, 3, 60.0) for n in range(3)]
    coordinators[0].first_round = False  # past the job's first attempt (the one that ran every node)
    every = inventories()
    for node in (0, 1):
        coordinators[node].publish_inventory(4, every[node])
        coordinators[node].publish_inventory(5, every[node])
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        live = f"127.0.0.1:{listening.getsockname()[1]}"
        probes: list[str] = []

        def counted(endpoint: str) -> bool:
            probes.append(endpoint)
            return connect_refused(endpoint)

        def planned(endpoints: list[str], attempt: int) -> tuple[threading.Thread, dict]:
            lead = RoundLead(coordinators[0], None, lambda line: None, ShrinkSettings(2, 3600.0), lambda: 0,
                             lambda: endpoints, EndpointProbe(check=counted))
            lead._ran_whole = True
            got: dict = {}
            t = threading.Thread(target=lambda: got.setdefault("plan", lead.plan(attempt, set())), daemon=True)
            t.start()
            return t, got

        shrunk, got = planned([live, live, f"127.0.0.1:{free_port()}"], 4)  # nothing listens on node 2's port
        wait_for(lambda: "plan" in got, 30, "the plan once node 2's endpoint refused")
        assert got["plan"].nodes == (0, 1), got
        probes.clear()
        waiting, got = planned([live, live, live], 5)
        # more probes than a refusing endpoint needs to be judged gone (MIN_REFUSALS, over REFUSED_FOR_S)
        wait_for(lambda: probes.count(live) > MIN_REFUSALS + 1, 30, "probes of node 2's listening endpoint")
        assert "plan" not in got and waiting.is_alive()  # a listening endpoint is silence, not a loss
        coordinators[2].publish_inventory(5, every[2])
        wait_for(lambda: "plan" in got, 30, "the plan once node 2 came")
        assert got["plan"].nodes is None and got["plan"].step == 20, got


def test_a_dcp_step_needs_every_part_on_every_node_and_a_part_only_its_owner_holds_stops_the_shrink() -> None:
    every = inventories("all")
    came = {0: every[0], 1: every[1]}
    why = compute_resized_plan(4, came, [0, 1])
    assert isinstance(why, str) and "rank 1's part is only in node 1's own directory" in why, why
    # replication_factor 2: every part on every other node
    full = [NodeInventory(n, {20: StepHoldings(3, {n: n}, {(n + 1) % 3: (n + 1) % 3, (n + 2) % 3: (n + 2) % 3},
                                               "all")}) for n in range(3)]
    plan = compute_resized_plan(4, {0: full[0], 1: full[1]}, [0, 1])
    assert isinstance(plan, RoundPlan)
    assert plan.fetch == {0: {1: [0], 2: [0, 1]}, 1: {0: [1], 2: [1, 0]}} and plan.from_nodes == 3


def test_the_saving_world_is_read_from_the_parts_owners() -> None:
    assert saved_by({n: inv for n, inv in enumerate(inventories())}, 20) == (3, {0, 1, 2})
    two = [NodeInventory(n, {30: StepHoldings(4, {2 * n: n, 2 * n + 1: n})}) for n in range(2)]
    assert saved_by(dict(enumerate(two)), 30) == (2, {0, 1})
    assert saved_by(dict(enumerate(two)), 99) is None


def test_a_plan_s_smaller_world_crosses_the_wire_and_bad_fields_are_refused() -> None:
    plan = RoundPlan(3, 20, 6, {1: {0: [1, 0]}}, (0, 1), {0: 0}, 3)
    back = RoundPlan.from_json(plan.to_json())
    assert back == plan and back.changes_world and back.runs(1) and not back.runs(2)
    assert RoundPlan.from_json(RoundPlan(3, 20, 6, {}).to_json()).nodes is None
    for field, bad in (("nodes", "[1, 0]"), ("nodes", "[]"), ("owners", '{"0": -2}'), ("from_nodes", "0")):
        text = plan.to_json().replace(f'"{field}": ', f'"{field}": {bad}, "x{field}": ', 1)
        with pytest.raises(RecordError, match=field):
            RoundPlan.from_json(text)
    with pytest.raises(RecordError, match="resize"):
        NodeInventory.from_json('{"node": 0, "steps": {"5": {"world_size": 1, "local": {"0": [0]}, '
                                '"replicas": {}, "resize": "some"}}}', 0)


class _Rejoin:
    """Node 2, back while nodes 0 and 1 run attempt 1 of the smaller world: its join and agreement in a thread."""

    def __init__(self, cluster: SimCluster) -> None:
        self.group = cluster.group(2, job_end=True)
        self.got: dict[str, object] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.got["attempt"] = self.group.join(0)
            self.group.agree(self.got["attempt"], lambda: None)  # type: ignore[arg-type]
        except BaseException as e:
            self.got["error"] = e


def _lead_sees_node_2_back(cluster: SimCluster, back: _Rejoin) -> None:
    """The lead's watch, looked at until it saw node 2's mark (and the newest save then)."""
    lead = cluster.groups[0]
    deadline = time.monotonic() + 10
    while lead._back is not None and lead._back.saved_before is None:
        assert time.monotonic() < deadline, cluster.nodes[2].lines
        lead._back.next_look = 0.0
        assert lead.peer_ended(1) is None
        back.thread.join(0.05)


def test_a_lost_node_back_waits_for_the_next_save_and_the_next_round_grows_the_job_back(tmp_path: Path) -> None:
    """Node 2 comes back empty while nodes 0 and 1 run attempt 1: its join does not end the attempt; it marks
    itself back and waits. The lead ends the attempt once its ranks saved a step after that (step 30, saved by
    the 2-node world); the next round runs all 3 nodes from step 30, node 2 fetching rank 0's part."""
    cluster = shrunk_cluster(tmp_path)
    shrunk = cluster.round(nodes=[0, 1])
    assert all(o.error is None for o in shrunk)
    lead = cluster.groups[0]
    lead.peer_ended(1)  # a look before node 2's mark: nothing to do
    back = _Rejoin(cluster)
    got, t = back.got, back.thread
    _lead_sees_node_2_back(cluster, back)
    assert got.get("attempt") == 1 and "error" not in got and cluster.store.keys  # it joined the running attempt
    lead._back.next_look = 0.0
    assert lead.peer_ended(1) is None  # no save since it came back
    cluster.save(30, world=[0, 1], resizable=True)
    cluster.replicate(30, nodes=[0, 1])
    lead._back.next_look = 0.0
    # asked once its own job ended (a failure of its own): never passed off as a grow, nothing ended
    assert lead.peer_ended(1, grow=False) is None and lead.coordinator.ended(1) is None
    ended = lead.peer_ended(1)
    assert ended is not None and "grow back to 3 nodes" in ended.detail and "step 30" in ended.detail
    assert ended.reason == EndReason.RESIZED  # not a failure: the restart policy does not count it
    assert cluster.groups[1].peer_ended(1) == ended  # and so it is on the other running node
    # node 1's ranks had just finished (step 30 was the job's last save): the grow came first, so node 1 goes on too
    assert cluster.groups[1].attempt_succeeded(1) == ended
    t.join(10)
    assert isinstance(got.get("error"), AttemptAbandoned) and got["error"].reason == EndReason.RESIZED, got
    grown = cluster.round()
    assert [(o.error, o.resume.step if o.resume else None) for o in grown] == [(None, 30)] * 3, grown
    plan = cluster.plans(2)[0]
    assert (plan.nodes, plan.world_size, plan.from_nodes) == ((0, 1, 2), 4, 2)
    assert (cluster.nodes[2].ckpt / step_dir_name(30) / manifest_name(0)).exists()
    assert any("grew back to 3 at step 30" in line for line in grown[0].lines), grown[0].lines
    assert cluster.groups[0].world() == World(3, 3, "grew back to 3 at step 30")
    assert grown[2].resume is not None and grown[2].resume.tier != TIER_LOCAL  # node 2's part came from a peer
    env = cluster.groups[2].env()
    assert (env[job_env.NUM_NODES], env[job_env.PREVIOUS_WORLD_SIZE]) == ("3", "4")
    assert cluster.groups[0].attempt_succeeded(2) is None  # every node runs: no grow to race with, nothing written
    assert cluster.groups[0].coordinator.ended(2) is None


@pytest.mark.parametrize("then", ["node 0 records the job's end", "node 0's ranks fail and it goes on"])
def test_a_success_at_the_job_s_last_save_wins_over_a_grow_back_started_after_it(tmp_path: Path, then: str) -> None:
    """Step 30 is the job's last save: node 1's ranks finish and claim the attempt's end before the lead's grow. The
    lead drops its grow and does not stop its own ranks (they finish too); a node 0 failure after it stays its own
    failure. Node 2, waiting to grow back (and a node 2 that joins only now), waits for node 0's word: the job's end
    (exit 0 without it), or node 0 going on to the next attempt (which node 2 joins)."""
    cluster = shrunk_cluster(tmp_path)
    assert all(o.error is None for o in cluster.round(nodes=[0, 1]))
    lead = cluster.groups[0]
    back = _Rejoin(cluster)
    _lead_sees_node_2_back(cluster, back)
    cluster.save(30, world=[0, 1], resizable=True)
    cluster.replicate(30, nodes=[0, 1])
    assert cluster.groups[1].attempt_succeeded(1) is None  # the success stands
    lead._back.next_look = 0.0
    assert lead.peer_ended(1) is None and lead.peer_ended(1, grow=False) is None  # nothing to stop, no failure
    assert lead.coordinator.keys.get("resize/1") is None  # the grow was dropped, never started
    assert any("before the grow back; the job ends on 2 nodes" in line for line in cluster.nodes[0].lines)
    assert lead.coordinator.ending(1) == ("node 1: its ranks finished", EndReason.SUCCESS)
    late = RoundCoordinator(cluster.store, JOB, SECRET, 2, 3, 60.0)
    assert late.join(0) == 1  # a node back only now waits with node 2, it does not open attempt 2
    back.thread.join(1.0)
    assert back.thread.is_alive() and "error" not in back.got, back.got  # one node's success is not the job's end
    if then == "node 0 records the job's end":
        assert lead.attempt_succeeded(1) is None
        lead.role.finish_job(None, 1)
    else:
        lead.coordinator.publish_inventory(2, lead._inventory())  # node 0 joined attempt 2
    back.thread.join(10)
    error = back.got.get("error")
    if then == "node 0 records the job's end":
        assert isinstance(error, JobEnded) and "says the job finished without this node" in str(error), back.got
    else:
        assert isinstance(error, AttemptAbandoned) and error.reason == EndReason.PEER_FAILURE, back.got


def test_only_a_launch_line_rlsup_pinned_can_be_given_fewer_nodes() -> None:
    from supervisor.launch.rank_pinning import resizable_launch, resize_pinned

    assert resizable_launch(PINNED)
    wrapper = ["bash", "run.sh", "--nnodes", "3", "--node-rank", "1"]  # not torchrun's: left as typed
    assert not resizable_launch(wrapper) and resize_pinned(wrapper, 0, 2) == wrapper
