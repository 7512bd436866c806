"""The job's first round and its liveness rule (supervisor.cluster.liveness), in-process over a real embedded store: a node
that reached the store and then died before the first attempt ends every other node's wait promptly, naming
it, as a lost peer (exit 75 on every node); a node that is merely slow (its beat goes on) is never failed;
node 0's embedded store gone in the first round ends the others' reconnect wait within the lapse. Beats and
lapse are shortened here (:data:`REFRESH_S`, :data:`LAPSE_S`); the rendezvous timeout is 300 s, so a wait
that ends at all ended on the rule. Also the lapse rule itself (:class:`LapseWatch`) and the abort record."""

from __future__ import annotations



from supervisor.cluster.liveness import Beat, LapseWatch
from supervisor.cluster.signed_keys import AbortKind, AbortNotice


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
