"""The end-to-end half of test_spare_probe.py (real processes, or waits on real time): a spare takes a lost node's
rank at once when the node's own host refuses its endpoint (its rlsup is gone), and waits the whole
``spare_takeover_s`` for a node whose endpoint still accepts (slow, stopped or hung: its socket is there)."""

from __future__ import annotations


import signal
import socket
import time

from supervisor.tiers.holdings import NodeInventory
from supervisor.settings_vocabulary import REFUSED_FOR_S
from supervisor.cluster.spares import Roster, SpareWatch, try_claim
from supervisor.stop_request import StopRequest
from support.ports import free_port
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.cluster.endpoint_probe import EndpointProbe, connect_refused
from supervisor.job_identity import JobIdentity


def test_a_missing_node_whose_endpoint_accepts_waits_for_the_window() -> None:
    alive = listening()
    with alive:
        roster = Roster(("127.0.0.1:1", "127.0.0.1:1", f"127.0.0.1:{alive.getsockname()[1]}", "127.0.0.1:1"),
                        spares=1)
        host, spare = round_missing_node_2(roster)
        watch = SpareWatch(spare, roster, 3, takeover_s=1.2, stop=StopRequest(signal.SIGUSR1))
        lost, after = lost_within(watch, 10.0)
        assert lost == (2, 0)
        assert after >= 1.2  # the window, not the probe, decided
        del host


def test_a_node_back_in_a_round_is_judged_afresh_in_the_next() -> None:
    """Review finding: refusals seen while a node restarted (under REFUSED_FOR_S, then it came back) were kept,
    and the node, listening again but a moment late in a later round, was taken at the spare's first look."""
    port = free_port()
    roster = Roster(("127.0.0.1:1", "127.0.0.1:1", f"127.0.0.1:{port}", "127.0.0.1:1"), spares=1)
    host, spare = round_missing_node_2(roster)
    watch = SpareWatch(spare, roster, 3, takeover_s=1.5, stop=StopRequest(signal.SIGUSR1))
    deadline = time.monotonic() + REFUSED_FOR_S * 0.8
    while time.monotonic() < deadline:  # refused, but not for long enough
        assert watch.lost_slot() is None
        time.sleep(0.05)
    alive = socket.socket()
    alive.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    alive.bind(("127.0.0.1", port))
    alive.listen(8)
    with alive:
        host.keys.set("inv/1/2", NodeInventory(2, {}).to_json())  # node 2 is back in the round
        assert watch.lost_slot() is None
        host.keys.set("round", "1")
        host.end(1, "a rank crashed")
        host.keys.set("inv/2/0", NodeInventory(0, {}).to_json())
        host.keys.set("inv/2/1", NodeInventory(1, {}).to_json())  # node 2, listening, is a moment late
        lost, after = lost_within(watch, 10.0)
        assert lost == (2, 0) and after >= 1.5, (lost, after)
    del host


def test_a_spare_that_just_claimed_a_rank_is_not_taken_for_gone() -> None:
    """Review finding: a spare that lost a claim race probed the winner's endpoint before the winner had bound it,
    and claimed again. A claim gets a whole window before its refusals count."""
    roster = Roster(("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1"), spares=2)
    host, spare = round_missing_node_2(roster)
    assert try_claim(host, 2, f"127.0.0.1:{free_port()}", 0) is not None  # spare A won, not listening yet
    watch = SpareWatch(spare, roster, 4, takeover_s=1.2, stop=StopRequest(signal.SIGUSR1))
    lost, after = lost_within(watch, 10.0)
    assert lost == (2, 1) and after >= 1.2, (lost, after)
    del host


JOB = JobIdentity("job-spare-probe", "test")


SECRET = b"0123456789abcdef-shared"


def listening() -> socket.socket:
    """An endpoint whose process is there but never answers (as a SIGSTOPped rlsup: the kernel still accepts)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def round_missing_node_2(roster: Roster) -> tuple[RoundCoordinator, RoundCoordinator]:
    """Attempt 0 ended; nodes 0 and 1 are in the next round, node 2 is not."""
    port = free_port()
    host = embedded_coordinator("127.0.0.1", port, JOB, SECRET, 0, roster.job_size, 10)
    spare = embedded_coordinator("127.0.0.1", port, JOB, SECRET, 3, roster.job_size, 10)
    host.keys.set("base", "0")
    host.publish_inventory(1, NodeInventory(0, {}))
    host.end(0, "node 2 lost")
    host.keys.set("inv/1/1", NodeInventory(1, {}).to_json())
    return host, spare


def lost_within(watch: SpareWatch, deadline_s: float) -> tuple[tuple[int, int] | None, float]:
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if (lost := watch.lost_slot()) is not None:
            return lost, time.monotonic() - start
        time.sleep(0.05)
    return None, time.monotonic() - start


def test_a_refused_endpoint_is_gone_and_a_listening_one_is_not() -> None:
    alive = listening()
    with alive:
        assert not connect_refused(f"127.0.0.1:{alive.getsockname()[1]}")
    assert connect_refused(f"127.0.0.1:{free_port()}")
    assert not connect_refused("127.0.0.1:not-a-port")  # malformed: silence, never evidence
    probe = EndpointProbe()
    dead = f"127.0.0.1:{free_port()}"
    assert not probe.gone(dead)  # one probe started, none answered yet
    deadline = time.monotonic() + 10
    while not probe.gone(dead):
        assert time.monotonic() < deadline, "a refused endpoint was never called gone"
        time.sleep(0.05)


def test_a_missing_node_whose_endpoint_refuses_is_taken_at_once() -> None:
    """Without the probe the spare would wait the 30 s window: it must claim within a few seconds."""
    roster = Roster(("127.0.0.1:1", "127.0.0.1:1", f"127.0.0.1:{free_port()}", "127.0.0.1:1"), spares=1)
    host, spare = round_missing_node_2(roster)
    watch = SpareWatch(spare, roster, 3, takeover_s=30.0, stop=StopRequest(signal.SIGUSR1))
    lost, after = lost_within(watch, 10.0)
    assert lost == (2, 0)
    assert after >= REFUSED_FOR_S  # one refusal is a moment: the run of refusals must last
    del host


def test_one_refusal_then_silence_is_not_gone() -> None:
    """Review finding: a refusal followed by a probe that hangs (a lost SYN, a stalled lookup) read as 'refused
    for 0.5 s'. Silence suspends the verdict, and a few refusals in a row are needed."""
    answers = iter([True])

    def check(endpoint: str) -> bool:
        refused = next(answers, None)
        if refused is None:
            time.sleep(2.0)  # silence: the probe hangs
            return False
        return refused

    probe = EndpointProbe(check=check)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert not probe.gone("h:1")
        time.sleep(0.05)

