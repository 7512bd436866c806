"""The end-to-end half of test_fr_exchange_waits.py (real processes, or waits on real time): the Flight Recorder
exchange's waits give up as soon as rlsup is asked to stop (a preemption's grace is short), saying why in the
verdict; and node 0 deletes the records it read (up to 1 MB a node) and an earlier exchange's keys."""

from __future__ import annotations

import subprocess
import sys
import threading

from support.waits import wait_for
from supervisor.diagnosis.flight_recorder import Analysis, finish_analysis
from test_fr_exchange_waits import DEADLINE_S, HOUR, in_thread, recorded
from supervisor.diagnosis.evidence import FlightEvidence
from test_fr_exchange_waits import hang_outcome, coordinators, exchange, raw


def test_the_analysers_child_is_killed_when_rlsup_is_asked_to_stop() -> None:
    stop = threading.Event()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # an analyser that would take its whole bound
    run = Analysis(recorded(range(4)), {}, {}, child=child)
    verdicts = []
    t = in_thread(lambda: verdicts.append(finish_analysis(run, HOUR, stop.is_set)))
    stop.set()
    wait_for(lambda: not t.is_alive(), DEADLINE_S, "finish_analysis to give up on its child")
    assert child.returncode is not None
    text = verdicts[0].text
    assert text.endswith("(torch's analyser cut short: rlsup asked to stop)") and "rank 2" in text, text


def test_a_chatty_analyser_is_drained_while_it_is_awaited() -> None:
    """More output than a pipe holds (torch logs to stderr): the wait reads it, so the child ends and answers."""
    answer = '{"pg": "0", "seq": 4, "lines": ["from the child"]}'
    code = f"import sys; sys.stderr.write('e' * 300000); sys.stdout.write('{answer}' + ' ' * 300000)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = Analysis(recorded(range(4)), {}, {}, child=child)
    verdicts = []
    t = in_thread(lambda: verdicts.append(finish_analysis(run, HOUR, lambda: False)))
    wait_for(lambda: not t.is_alive(), DEADLINE_S, "the analyser's answer")
    assert verdicts[0].analyser == ["from the child"] and "cut short" not in verdicts[0].text, verdicts[0]


def test_node_0_deletes_an_earlier_exchange_when_the_next_one_starts() -> None:
    coords, stop = coordinators(), threading.Event()
    nodes = [exchange(coords[n], n, stop, wait_s=10) for n in range(2)]
    nodes[1].hang(0, Analysis(recorded(range(2, 4)), {}, {}))
    shared: list[FlightEvidence | None] = []
    t = in_thread(lambda: shared.append(nodes[1].settle(0)))
    ours = nodes[0].settle(0)
    wait_for(lambda: not t.is_alive(), DEADLINE_S, "node 1 to read node 0's verdict")
    results = [hang_outcome(ours), hang_outcome(shared[0])]
    assert "rank 2" in (results[1].fr_verdict or "") and results[1].fr_verdict == results[0].fr_verdict
    assert [raw(coords[0], f"fr/0/{n}") for n in range(2)] == [None, None]  # read for good: deleted at once
    assert raw(coords[0], "fr/0/want") and raw(coords[0], "fr/0/verdict")  # others may still read these
    nodes[0].hang(1, Analysis(recorded(range(0, 2)), {}, {}))  # the next hang's exchange starts
    assert [raw(coords[0], f"fr/0/{n}") for n in ("want", "verdict")] == [None, None]
    assert raw(coords[0], "fr/1/0") is not None

