"""The job's first round and its liveness rule (supervisor.cluster.liveness), in-process over a real TCPStore: a node
that reached the store and then died before the first attempt ends every other node's wait promptly, naming
it, as a lost peer (exit 75 on every node); a node that is merely slow (its beat goes on) is never failed;
node 0's embedded store gone in the first round ends the others' reconnect wait within the lapse. Beats and
lapse are shortened here (:data:`REFRESH_S`, :data:`LAPSE_S`); the rendezvous timeout is 300 s, so a wait
that ends at all ended on the rule. Also the lapse rule itself (:class:`LapseWatch`) and the abort record."""

from __future__ import annotations

from typing import Callable

from support.waits import wait_for

from support import waits
from supervisor.tiers.holdings import NodeInventory
from supervisor.cluster.coordinator import PeerLost, RoundCoordinator, compute_plan, embedded_coordinator
from supervisor.job_identity import JobIdentity
from supervisor.cluster.liveness import Beat, LapseWatch
from supervisor.cluster.signed_keys import AbortKind, AbortNotice
from support.ports import free_ports

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


def test_the_lapse_rule() -> None:
    watch = LapseWatch(since=1000.0, lapse_s=10.0)
    old, new = Beat(7, "h", 1).to_payload(), Beat(1, "h2", 2).to_payload()
    # Node 1: a beat an earlier run left (written before the watcher started), never refreshed: not registered.
    # Node 2: written after the watcher started, then silent: lapses after 10 s of the watcher's clock.
    assert watch.look({1: (old, 900.0), 2: (new, 1001.0), 3: None}, now=0.0) is None
    assert watch.look({1: (old, 900.0), 2: (new, 1001.0)}, now=9.9) is None
    lapse = watch.look({1: (old, 900.0), 2: (new, 1001.0)}, now=10.0)
    assert lapse is not None and lapse.node == 2 and "node 2 (host h2, pid 2)" in lapse.describe()
    # A beat that changes is alive however long the wait; the old one, once it changes, is registered.
    watch = LapseWatch(since=1000.0, lapse_s=10.0)
    for i in range(1, 6):
        beat = Beat(i, "h", 1).to_payload()
        assert watch.look({1: (beat, 900.0 + i)}, now=i * 8.0) is None
    assert 1 in watch.registered
    assert watch.look({1: (beat, 905.0)}, now=5 * 8.0 + 10.0) is not None


def test_the_abort_record_reads_every_kind_and_the_old_clash_record() -> None:
    for kind in AbortKind:
        assert AbortNotice.from_payload(AbortNotice("why", kind).to_payload()) == AbortNotice("why", kind)
    assert AbortNotice.from_payload('{"why": "w", "clash": true}').clash
    assert AbortNotice.from_payload('{"why": "w", "kind": "from-a-newer-version"}') == AbortNotice("w")
    assert AbortNotice.from_payload("plain reason") == AbortNotice("plain reason")
