"""Out of spares, node 0 lost (issue 43): in a store that outlives node 0 (etcd), the nodes left go on without it.
In process (:mod:`support.in_process_round`: real parts, inventories, plans and copies over one in-memory store
standing for etcd): a node other than 0 claims the attempt's lead once neither the plan nor node 0's inventory came
within the shrink's wait, plans the smaller world, gathers its round, and launches torchrun with the master on the
first node that runs; node 0 back waits for the next save and the job grows back to every node. With the embedded
store (which goes with node 0) nobody claims: the nodes wait, as before.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlsup_format.manifest import manifest_name
from rlsup_format.names import step_dir_name
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.multinode import GROW_POLL_S
from supervisor.cluster.node_run import JOB_END_LINGER_S, NodeRun
from supervisor.cluster.round_errors import NodesMissing
from supervisor.cluster.round_lead import RoundMember, ShrinkSettings, Succession
from supervisor.launch.rank_pinning import resize_pinned
from supervisor.lifecycle import EndReason
from supervisor.run.loop import AttemptAbandoned
from supervisor.run.peers import World
from supervisor.lifecycle import JobStatus
from supervisor.run.record import RunResult
from supervisor.tiers.holdings import NodeInventory, RecordError, RoundPlan
from supervisor.tiers.parts import verify_part
from support.in_process_round import JOB, SECRET, SimCluster


@pytest.fixture(autouse=True)
def _quick_grow_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A left-out node looks for the attempt's end every GROW_POLL_S (1 s): a tenth of that here, where the store is
    in memory, so that a fast test does not sit out whole polls (what is looked at, and when, is unchanged)."""
    from supervisor.cluster import multinode

    monkeypatch.setattr(multinode, "GROW_POLL_S", 0.1)

SHRINK = ShrinkSettings(min_nodes=2, wait_s=0.2)
PINNED = ["torchrun", "--nproc-per-node", "2", "--nnodes", "3", "--node-rank", "1", "--rdzv-backend", "static",
          "--master-addr", "127.0.0.1", "--master-port", "29500", "train.py", "--master-addr", "x"]


def node_0_lost(tmp: Path, etcd_like: bool = True, probe: bool = False) -> SimCluster:
    """3 nodes of 2 ranks ran attempt 0 together (node 0 leading), saved steps 10 and 20 (replicated on the ring),
    then node 0 was lost with its disk."""
    cluster = SimCluster(tmp, shrink=SHRINK, etcd_like=etcd_like, probe=probe)
    for step in (10, 20):
        cluster.save(step, resizable=True)
        cluster.replicate(step)
    first = cluster.round()
    assert all(o.error is None for o in first), first
    assert cluster.plans(0)[0].lead == 0
    cluster.nodes[0].wipe()
    cluster.groups.pop(0)  # lost: a later node 0 is a new supervisor
    return cluster


def test_without_node_0_a_node_left_leads_and_the_two_go_on_from_the_newest_complete_step(tmp_path: Path) -> None:
    cluster = node_0_lost(tmp_path)
    assert all(isinstance(cluster.groups[n].role, Succession) for n in (1, 2))
    outcomes = cluster.round(nodes=[1, 2])
    assert [(o.error, o.resume.step if o.resume else None) for o in outcomes] == [(None, 20), (None, 20)], outcomes
    (plan,) = cluster.plans(1)
    assert (plan.nodes, plan.world_size, plan.from_nodes, plan.step) == ((1, 2), 6, 3, 20)
    lead = plan.lead
    assert lead in (1, 2) and [cluster.groups[n].role.leads for n in (1, 2)] == [n == lead for n in (1, 2)]
    said = [line for o in outcomes for line in o.lines if "leads the round in its place" in line]
    assert len(said) == 1 and f"node {lead} leads" in said[0], said
    # rank 0's part (node 0's, the torch backend's resize reads it on every node): node 1 keeps its replica (the
    # ring), node 2 fetches it from node 1
    assert plan.fetch == {1: {0: [1]}, 2: {0: [1]}} and plan.owners == {0: 0}
    for n in (1, 2):
        assert verify_part(cluster.nodes[n].ckpt / step_dir_name(20), 0) is not None
        assert cluster.groups[n].world() == World(2, 3, "continued on 2 of 3 nodes from step 20")
        # torchrun: node i of 2, its master on node 1's host (node 0's is gone); the script's own option untouched
        command = cluster.groups[n].command(PINNED)
        assert command[3:11] == ["--nnodes", "2", "--node-rank", str(n - 1), "--rdzv-backend", "static",
                                 "--master-addr", "127.0.0.2"], command
        assert command[-2:] == ["--master-addr", "x"]
    # the round's gathering was the lead's: the fetch results' and ready marks' unions are its words
    keys = cluster.groups[1].coordinator.keys
    assert keys.get("fetched/1/0/all").node == lead and keys.get("ready/1/all").node == lead


def test_a_node_waiting_for_node_0_s_plan_claims_nothing_while_node_0_s_inventory_is_there(tmp_path: Path) -> None:
    """Node 0 slow to plan (its inventory is in): the others wait for its plan; nobody else leads."""
    cluster = node_0_lost(tmp_path)
    coordinator = cluster.groups[1].coordinator
    cluster.groups[2].coordinator.publish_inventory(5, cluster.groups[2]._inventory())
    started = time.monotonic()
    assert coordinator.plan_or_absent(5, 2, 5.0, lambda: False) is False  # node 2's inventory: there
    assert time.monotonic() - started < 2.0
    assert coordinator.plan_or_absent(5, 0, 0.2, lambda: False) is True  # node 0's: not within the wait
    assert coordinator.plan_or_absent(6, 0, 60.0, lambda: True) is True  # node 0's endpoint refuses: at once


def test_node_0_always_claims_the_lead_and_a_later_claim_loses(tmp_path: Path) -> None:
    cluster = node_0_lost(tmp_path)
    assert cluster.store.get(cluster.groups[1].coordinator.keys.key("lead/0")) is not None  # node 0 claimed attempt 0
    one, two = cluster.groups[1].coordinator, cluster.groups[2].coordinator
    assert one.claim_lead(7) == 1 and two.claim_lead(7) == 1 and two.lead_of(7) == 1 and not two.leads(7)


def test_with_the_embedded_store_nobody_takes_node_0_s_place(tmp_path: Path) -> None:
    """The embedded store goes with node 0 (here it stays, to show the rule): the nodes left read node 0's plan only,
    and wait for it until rendezvous_timeout (then exit 75 for a requeue, as before)."""
    cluster = node_0_lost(tmp_path, etcd_like=False)
    assert isinstance(cluster.groups[1].role, RoundMember)
    for n in (1, 2):
        cluster.groups[n] = cluster.group(n, timeout_s=1.0)
    outcomes = cluster.round(nodes=[1, 2])
    assert all(isinstance(o.error, AttemptAbandoned) or isinstance(o.error, NodesMissing) for o in outcomes), outcomes
    assert cluster.plans(1) == []


def test_node_0_back_waits_for_the_next_save_and_the_job_grows_back_to_every_node(tmp_path: Path) -> None:
    cluster = node_0_lost(tmp_path)
    shrunk = cluster.round(nodes=[1, 2])
    assert all(o.error is None for o in shrunk), shrunk
    lead = cluster.plans(1)[0].lead
    back = cluster.group(0, job_end=True)  # node 0's rlsup again, its disk empty
    got: dict[str, object] = {}

    def rejoin() -> None:
        try:
            got["attempt"] = back.join(0)
            back.agree(got["attempt"], lambda: None)  # type: ignore[arg-type]
        except BaseException as e:
            got["error"] = e
    thread = threading.Thread(target=rejoin, daemon=True)
    thread.start()
    watch = cluster.groups[lead]
    deadline = time.monotonic() + 10
    while watch._back is not None and watch._back.saved_before is None:  # the lead's look, until it saw node 0 back
        assert time.monotonic() < deadline, cluster.nodes[0].lines
        watch._back.next_look = 0.0
        assert watch.peer_ended(1) is None
        thread.join(0.05)
    assert got.get("attempt") == 1 and "error" not in got, got  # joined the running attempt, not ended it
    assert not back.role.leads and cluster.groups[1].coordinator.lead_of(1) == lead  # node 0's claim lost
    # back in a running job, node 0 may lead its next round without waiting for a node that is lost for good
    assert back.role.planner.floor_now() == 2
    cluster.save(30, world=[1, 2], resizable=True)
    cluster.replicate(30, world=[1, 2])
    watch._back.next_look = 0.0
    ended = watch.peer_ended(1)
    assert ended is not None and ended.reason == EndReason.RESIZED and "grow back to 3 nodes" in ended.detail
    thread.join(10)
    assert isinstance(got.get("error"), AttemptAbandoned) and got["error"].reason == EndReason.RESIZED, got
    grown = cluster.round()
    assert [(o.error, o.resume.step if o.resume else None) for o in grown] == [(None, 30)] * 3, grown
    (plan,) = cluster.plans(2)
    assert (plan.nodes, plan.world_size, plan.from_nodes) == ((0, 1, 2), 4, 2)
    assert (cluster.nodes[0].ckpt / step_dir_name(30) / manifest_name(0)).exists()
    assert cluster.groups[0].world() == World(3, 3, "grew back to 3 at step 30")
    # torchrun's master is node 0's again: the command is left as pinned
    assert cluster.groups[1].command(PINNED)[3:11] == ["--nnodes", "3", "--node-rank", "1", "--rdzv-backend",
                                                       "static", "--master-addr", "127.0.0.1"]


def test_only_the_pinned_master_address_is_moved() -> None:
    assert resize_pinned(PINNED, 0, 2, "10.0.0.2")[3:11] == ["--nnodes", "2", "--node-rank", "0", "--rdzv-backend",
                                                             "static", "--master-addr", "10.0.0.2"]
    assert resize_pinned(PINNED, 0, 2)[9:11] == ["--master-addr", "127.0.0.1"]
    typed = ["python", "train.py", "--nnodes", "3", "--master-addr", "h"]
    assert resize_pinned(typed, 0, 2, "10.0.0.2") == typed  # a line rlsup did not pin: as typed


def test_a_plan_s_lead_crosses_the_wire_and_must_run_the_attempt() -> None:
    plan = RoundPlan(4, 20, 6, {}, (1, 2), {0: 0}, 3, lead=2)
    assert RoundPlan.from_json(plan.to_json()) == plan
    assert '"lead"' not in RoundPlan(4, 20, 6, {}).to_json()  # node 0's plans are as they were on the wire
    for bad in ('"lead": 0', '"lead": -1', '"lead": "1"'):
        with pytest.raises(RecordError, match="lead"):
            RoundPlan.from_json('{"round": 4, "step": 20, "world_size": 6, "fetch": {}, "nodes": [1, 2], '
                                f'"owners": {{}}, "from_nodes": 3, {bad}}}')


def test_a_claim_a_node_made_before_its_rlsup_was_restarted_is_still_its_own(tmp_path: Path) -> None:
    """Node 1 claimed attempt 1's lead, and the run ended before its plan (a requeue): in the next run (fresh
    supervisors, every node back) node 1 plans attempt 1 as the lead it is; nobody waits for a plan that never comes."""
    cluster = node_0_lost(tmp_path)
    one = cluster.groups[1].coordinator
    one.end(0, "node 1: the run ended")
    assert one.claim_lead(1) == 1
    cluster.groups.clear()  # the requeued run: every node's rlsup anew
    outcomes = cluster.round()
    assert [(o.error, o.resume.step if o.resume else None) for o in outcomes] == [(None, 20)] * 3, outcomes
    (plan,) = cluster.plans(1)
    assert plan.lead == 1 and plan.nodes is None  # a fresh run waits for every node: node 0 back, nothing missed


def test_a_lead_gone_before_its_plan_ends_the_attempt_and_the_next_round_has_a_lead(tmp_path: Path) -> None:
    """Node 0 joined attempt 1, published its inventory, claimed the lead, and died before its plan: the nodes left
    see its endpoint refuse connects and end the attempt (they would otherwise wait for its plan until
    rendezvous_timeout); the next round is led by one of them and runs without node 0."""
    cluster = node_0_lost(tmp_path, probe=True)
    one = cluster.groups[1].coordinator
    one.end(0, "node 1: node 0's ranks are gone")
    ghost = RoundCoordinator(cluster.store, JOB, SECRET, 0, 3, 10.0)  # node 0's last words in the round
    ghost.publish_inventory(1, NodeInventory(0))
    assert ghost.claim_lead(1) == 0
    ended = cluster.round(nodes=[1, 2])
    assert all(isinstance(o.error, AttemptAbandoned) and o.attempt == 1 for o in ended), ended
    assert "node 0, the lead of attempt 1, is gone before its plan" in (one.ended(1) or "")
    outcomes = cluster.round(nodes=[1, 2])
    assert [(o.error, o.resume.step if o.resume else None) for o in outcomes] == [(None, 20)] * 2, outcomes
    (plan,) = cluster.plans(2)
    assert plan.nodes == (1, 2) and plan.lead in (1, 2)


def test_the_lead_of_a_smaller_world_keeps_the_job_s_end_in_the_store_a_moment_for_a_node_left_out() -> None:
    """A node left out of the world that finished looks for ``done`` every second: the lead clears the job's keys
    only after a linger (a full world's end clears them at once, as before)."""
    events: list[str] = []

    class Stop:
        def wait(self, seconds: float, poll: float) -> None:
            events.append(f"linger {seconds:g}")

    class Coordinator:
        def finish(self, attempt: int) -> None:
            events.append(f"finish {attempt}")

    class Role:
        leads = True

        def finish_job(self, job_end: object, last_attempt: int) -> None:
            events.append("done")

    run = SimpleNamespace(stop=Stop(), settings=SimpleNamespace(run=SimpleNamespace(poll_interval=0.1)))
    result = RunResult(0, JobStatus.SUCCEEDED, 3, [])
    NodeRun._job_done(run, Coordinator(), Role(), None, result, smaller=True)  # type: ignore[arg-type]
    assert events == ["done", f"linger {JOB_END_LINGER_S:g}", "finish 2"] and JOB_END_LINGER_S >= 2 * GROW_POLL_S
    events.clear()
    NodeRun._job_done(run, Coordinator(), Role(), None, result)  # type: ignore[arg-type]
    assert events == ["done", "finish 2"]


def test_a_spare_holding_node_0_s_rank_is_torchrun_s_master_on_every_node(tmp_path: Path) -> None:
    """A spare on another host took node rank 0 (the engine's peers moved): the other nodes launch torchrun with the
    master on the spare's host, not on the lost node 0's; the spare itself, and a job whose node 0 never moved, keep
    the line as pinned."""
    cluster = SimCluster(tmp_path)
    cluster.save(10)
    cluster.replicate(10)
    assert all(o.error is None for o in cluster.round())
    assert cluster.groups[1].command(PINNED) == PINNED
    cluster.groups[1].engine.move_peer(0, "127.0.0.9:9100")
    command = cluster.groups[1].command(PINNED)
    assert command[3:11] == ["--nnodes", "3", "--node-rank", "1", "--rdzv-backend", "static", "--master-addr",
                             "127.0.0.9"] and command[-2:] == ["--master-addr", "x"], command
