"""The end-to-end half of test_first_round_liveness.py (real processes, or waits on real time): the job's first
round and its liveness rule (supervisor.cluster.liveness), in-process over a real embedded store: a node that reached the
store and then died before the first attempt ends every other node's wait promptly, naming it, as a lost peer (exit
75 on every node); a node that is merely slow (its beat goes on) is never failed; node 0's embedded store gone in
the first round ends the others' reconnect wait within the lapse."""

from __future__ import annotations




from supervisor.tiers.holdings import NodeInventory
from supervisor.cluster.round_errors import PeerLost
from support.ports import free_ports
import threading
from typing import Callable
from support.waits import wait_for
from support import waits
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.round_plan import compute_plan
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.job_identity import JobIdentity
from supervisor.cluster.liveness import Beat
from supervisor.cluster.signed_keys import AbortKind, AbortNotice


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


JOB = JobIdentity("job-l", "test")


SECRET = b"0123456789abcdef-liveness"


TIMEOUT_S = 300.0  # rendezvous_timeout: never waited out here


REFRESH_S, LAPSE_S = 0.05, 0.5


PROMPT_S = 30.0  # the deadline on each wait's end (a thread join), far below TIMEOUT_S


def node(port: int, rank: int, nodes: int = 3) -> RoundCoordinator:
    c = embedded_coordinator("127.0.0.1", port, JOB, SECRET, rank, nodes, TIMEOUT_S)
    c.refresh_s, c.lapses.lapse_s = REFRESH_S, LAPSE_S
    return c


def in_thread(call: Callable[[], object]) -> Callable[[], object]:
    return waits.in_thread(call, PROMPT_S)


def joined(port: int) -> list[RoundCoordinator]:
    """Three nodes through their first join (attempt 0), each beating."""
    nodes = [node(port, rank) for rank in range(3)]
    joins = [in_thread(lambda c=c: c.join(0)) for c in nodes]
    assert [j() for j in joins] == [0, 0, 0]
    assert all(c.first_round and c.beat is not None and c.beat.running for c in nodes)
    return nodes


def seq_seen(watcher: RoundCoordinator, node: int) -> int:
    seen = watcher.lapses.seen.get(node)
    beat = Beat.from_payload(seen[0]) if seen else None
    return beat.seq if beat else 0


def test_a_node_dead_after_its_join_ends_the_first_round_for_the_others() -> None:
    (port,) = free_ports(1)
    leader, member, dead = joined(port)
    dead.beat.stop()  # node 2's process is gone: its beat stops, its inventory never comes
    leader.publish_inventory(0, NodeInventory(0))
    member.publish_inventory(0, NodeInventory(1))
    waits = [in_thread(lambda: leader.inventories(0)), in_thread(lambda: member.plan(0))]
    for wait in waits:
        e = wait()
        assert isinstance(e, PeerLost), repr(e)
        assert "node 2 (host " in str(e) and "liveness beat stopped" in str(e), str(e)
        assert "before the job's first attempt" in str(e), str(e)
    abort = leader.keys.get("abort")
    assert abort is not None and AbortNotice.from_payload(abort.payload).kind is AbortKind.PEER_LOST


def test_a_node_killed_before_its_beats_thread_wrote_is_still_judged() -> None:
    """A busy host: node 2's beat thread is still connecting when node 2 is killed (CI saw this: the others then
    waited out rendezvous_timeout, the node never registered). Its join wrote its first beat itself."""
    (port,) = free_ports(1)
    never = threading.Event()
    nodes = [node(port, rank) for rank in range(3)]

    def connect_never() -> None:  # node 2's thread: its connect never returns (until the test ends)
        never.wait()

    nodes[2]._beat_store = connect_never
    nodes[0].lapses.lapse_s = PROMPT_S  # node 2 beats once only: the joins of a loaded machine must not lapse it
    joins = [in_thread(lambda c=c: c.join(0)) for c in nodes]
    assert [j() for j in joins] == [0, 0, 0]
    leader, member, dead = nodes
    assert leader.keys.get("live/2") is not None  # the join's own beat
    dead.beat.stop()  # killed: its thread never wrote
    leader.lapses.lapse_s = LAPSE_S
    leader.publish_inventory(0, NodeInventory(0))
    member.publish_inventory(0, NodeInventory(1))
    e = in_thread(lambda: leader.inventories(0))()
    never.set()
    assert isinstance(e, PeerLost) and "node 2 (host " in str(e), repr(e)


def test_a_slow_node_whose_beat_goes_on_is_never_failed() -> None:
    (port,) = free_ports(1)
    leader, member, slow = joined(port)
    leader.publish_inventory(0, NodeInventory(0))
    member.publish_inventory(0, NodeInventory(1))
    inventories = in_thread(lambda: leader.inventories(0))
    plan = in_thread(lambda: member.plan(0))
    start = seq_seen(leader, 2)
    beats_in_3_lapses = int(3 * LAPSE_S / REFRESH_S)
    wait_for(lambda: seq_seen(leader, 2) >= start + beats_in_3_lapses, PROMPT_S,
             "node 0 to watch node 2's beat for three lapses while node 2 is busy elsewhere")
    slow.publish_inventory(0, NodeInventory(2))
    got = inventories()
    assert isinstance(got, list) and len(got) == 3, got
    leader.publish_plan(compute_plan(0, got))
    assert plan().attempt == 0
    assert leader.keys.get("abort") is None

