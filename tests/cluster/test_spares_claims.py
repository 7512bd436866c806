"""Spare nodes' claims through a real embedded store, in process: one slot goes to one spare,
a spare claims once, the node that held the slot before is refused, and a slot is lost only when a round has
waited for it for ``spare_takeover_s`` while the other nodes are in it."""

from __future__ import annotations

import signal
import time

import pytest

from supervisor.tiers.holdings import NodeInventory
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.job_identity import JobIdentity
from supervisor.cluster.spares import (DONE_KEY, JobEnded, NodeRole, Roster, SlotTaken, SpareWatch, check_holder, check_seat,
                               job_done, moved_slots, newest_claim, taken_over, try_claim)
from supervisor.stop_request import StopRequest
from support.ports import free_port

JOB = JobIdentity("job-spares", "test")
SECRET = b"0123456789abcdef-shared"
ROSTER = Roster(("h0:1", "h1:1", "h2:1", "s0:1", "s1:1"), spares=2)


def node(port: int, rank: int) -> RoundCoordinator:
    return embedded_coordinator("127.0.0.1", port, JOB, SECRET, rank, ROSTER.job_size, 10)


def test_roster_roles_and_the_membership_a_spare_takes() -> None:
    assert [ROSTER.role(r) for r in range(5)] == [NodeRole.WORKER] * 3 + [NodeRole.SPARE] * 2
    assert ROSTER.membership(1).peers == ("h0:1", "h1:1", "h2:1")
    port = free_port()
    host = node(port, 0)
    spare = node(port, 3)
    claim = try_claim(spare, 2, "s0:1", 0)
    assert claim is not None
    m = taken_over(ROSTER, claim, moved_slots(spare, ROSTER.job_size))
    assert (m.peers, m.node_rank) == (("h0:1", "h1:1", "s0:1"), 2)
    del host


def test_one_slot_goes_to_one_spare_and_the_old_holder_is_refused() -> None:
    port = free_port()
    host, old2, a, b = node(port, 0), node(port, 2), node(port, 3), node(port, 4)
    check_holder(old2, 2, 0)  # nobody claimed it: the original holds it
    won = try_claim(a, 2, "s0:1", 0)
    lost = try_claim(b, 2, "s1:1", 0)  # the same generation: the first writer won
    assert won is not None and won.gen == 1 and lost is None
    claim = newest_claim(host, 2)
    assert claim is not None and claim.endpoint == "s0:1"
    with pytest.raises(SlotTaken, match="restart it as a spare"):
        check_holder(old2, 2, 0)
    check_holder(a, 2, 1)  # the spare holds it by its claim
    again = try_claim(b, 2, "s1:1", 1)  # a later loss of the same rank: the next generation
    assert again is not None and again.gen == 2
    with pytest.raises(SlotTaken):
        check_holder(a, 2, 1)
    assert {s: c.endpoint for s, c in moved_slots(host, 3).items()} == {2: "s1:1"}


def test_a_slot_is_lost_only_after_the_round_waited_for_it() -> None:
    port = free_port()
    host = node(port, 0)
    spare = node(port, 3)
    watch = SpareWatch(spare, ROSTER, 3, takeover_s=0.3, stop=StopRequest(signal.SIGUSR1))
    assert watch.lost_slot() is None  # no attempt yet
    host.keys.set("base", "0")
    host.publish_inventory(1, NodeInventory(0, {}))
    assert watch.lost_slot() is None  # attempt 0 runs: nobody waits for a node
    host.end(0, "node 2 lost")
    host.keys.set("inv/1/1", NodeInventory(1, {}).to_json())
    assert watch.lost_slot() is None  # node 2 is missing, but not for long yet
    time.sleep(0.35)
    assert watch.lost_slot() == (2, 0)


def test_a_done_left_by_an_earlier_run_ends_no_node_of_this_one() -> None:
    """Review finding (issue 41): ``done`` said "the job finished" whenever it was in the store, so one an earlier run
    of the same job left in a store that outlives jobs (etcd, node 0's clear failed) made every node of a new run
    exit 0 at its first join, and an idle spare with it. Only a ``done`` written after the node reached the store
    counts, as for the JobEnd record."""
    port = free_port()
    earlier = node(port, 0)  # the earlier run's node 0, into the store both runs share
    earlier.keys.set(DONE_KEY, "1")
    stale = earlier.keys.get(DONE_KEY)
    assert stale is not None
    while time.time() <= stale.time:  # this run's nodes reach the store after the earlier run's last word
        time.sleep(0.001)
    node1, spare = node(port, 1), node(port, 3)
    assert not job_done(node1) and not job_done(spare)
    check_seat(node1, 1, 0)  # no JobEnded: the node joins this run
    earlier.keys.set(DONE_KEY, "1")  # written now (this run's node 0, signing as rank 0 too): the job finished
    assert job_done(node1) and job_done(spare)
    with pytest.raises(JobEnded, match="says the job finished without this node"):
        check_seat(node1, 1, 0)
    del earlier


def test_role_spares_left_and_takeover_are_exported() -> None:
    from supervisor.cli.metrics import SupervisorMetrics
    from supervisor.cluster.spares import spares_left

    m = SupervisorMetrics(job="j", node="n")
    m.node_role(NodeRole.SPARE.value, 2)
    assert m.registry.get_sample_value("rlsup_node_role", {"rlsup_node_role": "spare"}) == 1
    port = free_port()
    host = node(port, 0)
    try_claim(host, 1, "s0:1", 0)
    left = spares_left(ROSTER, moved_slots(host, ROSTER.job_size))
    m.node_role(NodeRole.WORKER.value, left)
    m.spare_took_over(1.5)
    assert m.registry.get_sample_value("rlsup_node_role", {"rlsup_node_role": "worker"}) == 1
    assert m.registry.get_sample_value("rlsup_spares_left") == 1
    assert m.registry.get_sample_value("rlsup_spare_takeover_seconds") == 1.5


def test_a_takeover_wait_of_zero_is_refused_naming_the_key() -> None:
    """0 would call a node lost at its first refused connect (review finding): refused at load, the key named."""
    from supervisor.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="spare_takeover_s"):
        load_config(environ={}, overrides={"spare_takeover_s": 0})


def test_a_spare_hosts_node_0s_store_only_on_an_address_of_its_own() -> None:
    """Off node 0's host a spare cannot serve node 0's address (review finding: torch's store listens on every
    interface while its client writes to node 0's address, a live node 0's store if it came back)."""
    from supervisor.cluster.spare_run import is_local_address

    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: never this host's
