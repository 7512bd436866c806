"""A spare takes a lost node's rank at once when the node's own host refuses its endpoint (its rlsup is gone),
and waits the whole ``spare_takeover_s`` for a node whose endpoint still accepts (slow, stopped or hung: its
socket is there). Real sockets and a real embedded store (torch TCPStore), in process."""

from __future__ import annotations

import signal
import socket
import time

from supervisor.tiers.holdings import NodeInventory
from supervisor.settings_vocabulary import REFUSED_FOR_S
from supervisor.cluster.spares import Roster, SpareWatch, try_claim
from supervisor.stop_request import StopRequest
from support.ports import free_port
from test_spare_probe import listening, lost_within, round_missing_node_2


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
