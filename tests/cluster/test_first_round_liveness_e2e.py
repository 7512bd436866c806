"""The job's first round and its liveness rule (supervisor.cluster.liveness), in-process over a real TCPStore: a node
that reached the store and then died before the first attempt ends every other node's wait promptly, naming
it, as a lost peer (exit 75 on every node); a node that is merely slow (its beat goes on) is never failed;
node 0's embedded store gone in the first round ends the others' reconnect wait within the lapse. Beats and
lapse are shortened here (:data:`REFRESH_S`, :data:`LAPSE_S`); the rendezvous timeout is 300 s, so a wait
that ends at all ended on the rule. Also the lapse rule itself (:class:`LapseWatch`) and the abort record."""

from __future__ import annotations



from supervisor.tiers.holdings import NodeInventory
from supervisor.cluster.coordinator import PeerLost
from support.ports import free_ports
from test_first_round_liveness import in_thread, joined


def test_node_0_lost_in_the_first_round_ends_the_reconnect_wait_within_the_lapse() -> None:
    (port,) = free_ports(1)
    leader, member, other = joined(port)
    member.publish_inventory(0, NodeInventory(1))
    plan = in_thread(lambda: member.plan(0))
    leader.end_first_round()
    leader.store.close()  # node 0's supervisor is gone, and the store it hosted with it
    del leader
    ended = plan()  # the round ends (the store is gone); the run loop's next join waits for node 0
    assert not isinstance(ended, PeerLost) and "ended while waiting for the plan" in str(ended), repr(ended)
    e = in_thread(lambda: member.join(1))()
    assert isinstance(e, PeerLost), repr(e)
    assert "node 0 hosted the coordination store" in str(e) and "before the job's first attempt" in str(e), str(e)


