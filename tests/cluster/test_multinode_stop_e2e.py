"""SIGTERM and the preemption signal end real ``rlsup run`` nodes at once while they wait for each other (issue
32: a node once sat 7 minutes in its first join after SIGTERM). A job of 3 nodes on 127.0.0.1 whose node 2
never starts, rendezvous_timeout 300 s: node 1 alone waits for the store (nobody hosts it yet), then node
0 waits for every node to join and node 1 for node 0 to open the first attempt. Each signal must end its
node within :data:`PROMPT_S` (a deadline on the wait for its exit, far below the timeout) with the stop's
exit code, the reason in its log, the attempt recorded as stopped or preempted, and no rank launched.
The per-wait matrix (plan, fetch, ready, the reconnect after node 0 is lost) is test_coordination_stop's.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from support.cluster import Cluster
from support.incidents import incidents
from support.waits import wait_for

PROMPT_S = 30.0


def exit_code(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=PROMPT_S)
    except subprocess.TimeoutExpired:
        return -999  # still waiting: the assertion names it


def test_sigterm_and_the_preemption_signal_end_the_coordination_waits(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, 3, rendezvous_timeout=300)
    try:
        # Node 1 alone: node 0 hosts no store yet.
        cluster.start(1)
        wait_for(lambda: "reaching the coordination store" in cluster.log(1), 60, "node 1 waiting for the store")
        cluster.procs[1].send_signal(signal.SIGTERM)
        assert exit_code(cluster.procs[1]) == 128 + signal.SIGTERM, cluster.log(1)
        assert "asked to stop (SIGTERM) while waiting for the coordination store" in cluster.log(1), cluster.log(1)

        # Nodes 0 and 1; node 2 never comes.
        cluster.start(0)
        cluster.start(1)
        wait_for(lambda: "waiting for every node to join" in cluster.log(0), 60, "node 0 waiting for node 2")
        wait_for(lambda: "waiting for node 0 to open the first attempt" in cluster.log(1), 60,
                 "node 1 waiting for node 0")
        cluster.procs[1].send_signal(signal.SIGUSR1)  # the default preempt_signal
        assert exit_code(cluster.procs[1]) == 75, cluster.log(1)
        cluster.procs[0].send_signal(signal.SIGTERM)
        assert exit_code(cluster.procs[0]) == 128 + signal.SIGTERM, cluster.log(0)
    finally:
        cluster.kill_all()
    for node, status, why in ((0, "stopped", "(SIGTERM) while waiting for every node to join"),
                              (1, "preempted", "(SIGUSR1, preemption) while waiting for node 0 to open the first")):
        log = cluster.log(node)
        assert f"asked to stop {why}" in log, log
        assert "launching" not in log, log
        state = cluster.state(node)
        assert state["state"] == status and state["exit_code"] == (143 if node == 0 else 75), state
        [incident] = incidents(cluster.node_dir(node) / ".rlsup")
        assert incident["reason"] == status and incident["action"] == "stop" and why in incident["detail"], incident
