"""The Flight Recorder exchange's waits give up as soon as rlsup is asked to stop (a preemption's grace is
short), saying why in the verdict; and node 0 deletes the records it read (up to 1 MB a node) and an earlier
exchange's keys. Through a real embedded store; each wait is given an hour, so only the stop can end it within the
test's deadline."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from rlsup_format.heartbeat_record import fr_dump_name
from support.ports import free_ports
from support.waits import wait_for
from supervisor.diagnosis.evidence import AttemptEvidence, FlightEvidence, HangSeen
from supervisor.diagnosis.outcome import AttemptResult, classify
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.diagnosis.flight_recorder import Analysis, normalise, read_dump
from supervisor.cluster.fr_exchange import FrExchange
from supervisor.diagnosis.fr_records import NodeDumps
from supervisor.job_identity import JobIdentity
from supervisor.lifecycle import EndReason
from supervisor.observer import Observer

DATA = Path(__file__).resolve().parents[1] / "data" / "flight_recorder" / "skipped_in_other_group"  # rank 2 skipped #4
HOUR = 3600.0
DEADLINE_S = 30.0  # generous: the stop ends each wait within a poll


def hang_outcome(shared: FlightEvidence | None, local: str = "") -> AttemptResult:
    """A hang's outcome on this node with the verdict across nodes ``shared`` (``local``: its own FR verdict)."""
    return classify(AttemptEvidence(0, HangSeen(EndReason.HANG, ""), flight=FlightEvidence(local) if local else None,
                                    shared_flight=shared))

def coordinators(nodes: int = 2) -> list[RoundCoordinator]:
    port = free_ports(1)[0]
    job = JobIdentity("job-w", "test")
    return [embedded_coordinator("127.0.0.1", port, job, b"0123456789abcdef-shared", n, nodes, 10)
            for n in range(nodes)]


def exchange(coord: RoundCoordinator, node: int, stop: threading.Event, wait_s: float = HOUR) -> FrExchange:
    return FrExchange(coord, node, 2, f"host{node}", Observer(), gather_s=wait_s, analyse_s=wait_s,
                      stopped=stop.is_set)


def in_thread(fn: Callable[[], object]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def raw(coord: RoundCoordinator, name: str) -> bytes | None:
    return coord.store.get(coord.keys.key(name))


def recorded(ranks: range) -> dict[int, dict]:
    out = {}
    for r in ranks:
        dump = read_dump(DATA / fr_dump_name(r))
        assert dump is not None
        out[r] = normalise(dump)
    return out


def test_node_0_stops_gathering_when_asked_to_stop_and_says_so() -> None:
    coords, stop = coordinators(), threading.Event()
    coords[0].keys.create("fr/0/want", "0")
    shared: list[FlightEvidence | None] = []
    t = in_thread(lambda: shared.append(exchange(coords[0], 0, stop).settle(0)))
    wait_for(lambda: raw(coords[0], "fr/0/0"), DEADLINE_S, "node 0's own record (it then waits for node 1's)")
    stop.set()
    wait_for(lambda: not t.is_alive(), DEADLINE_S, "node 0's settle to give up on node 1")
    verdict = hang_outcome(shared[0]).fr_verdict
    assert "node 1 shared no dumps (rlsup asked to stop)" in verdict, verdict
    assert raw(coords[0], "fr/0/verdict") is not None  # what came is still published
    assert raw(coords[0], "fr/0/0") is None  # and the records read are gone


def test_a_node_stops_awaiting_the_verdict_when_asked_to_stop_and_says_so() -> None:
    coords, stop = coordinators(), threading.Event()
    coords[0].keys.create("fr/0/want", "0")
    shared: list[FlightEvidence | None] = []
    t = in_thread(lambda: shared.append(exchange(coords[1], 1, stop).settle(0)))
    wait_for(lambda: raw(coords[1], "fr/0/1"), DEADLINE_S, "node 1's record (it then waits for the verdict)")
    stop.set()
    wait_for(lambda: not t.is_alive(), DEADLINE_S, "node 1's settle to give up on the verdict")
    result = hang_outcome(shared[0], local="flight recorder: ranks 2, 3 wait")
    assert result.fr_verdict == ("flight recorder: ranks 2, 3 wait (no verdict across nodes: rlsup asked to stop)")


def test_the_hang_node_stops_awaiting_the_peers_records_when_asked_to_stop() -> None:
    coords, stop = coordinators(), threading.Event()
    ours = exchange(coords[1], 1, stop)
    ours.hang(0, Analysis(recorded(range(2, 4)), {}, {}))
    assert NodeDumps.from_json(coords[0].keys.get("fr/0/1").payload, 1, "k").dumps.keys() == {2, 3}
    t = in_thread(lambda: ours.await_peers(0))  # node 0 never answers
    stop.set()
    wait_for(lambda: not t.is_alive(), DEADLINE_S, "await_peers to give up")


