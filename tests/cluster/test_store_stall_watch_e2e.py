"""The run loop's watch of another node's end goes on after the store stalled (issue 32, review finding 7).

Node 0's embedded store is hosted by a process of its own (as node 0's supervisor hosts it); node 1 is a
real NodeGroup (NodeRun's) in this process, over a real embedded-store client, its watch polled as the run loop
polls it (``peer_ended``). The store's process is SIGSTOPped: node 1's read gets no answer, and the store
gives that connection up after its operation timeout (StoreUnavailable, for good: a late answer could come
out of turn). SIGCONT, then node 0 ends the attempt. Node 1's watch must see that end: it reaches the store
again (a bounded try every few seconds) instead of staying blind until the next join, which is where it
stayed before the fix (every later read failed at once on the given-up connection). The tries made while
the store's process is still stopped must each end too: torch's client connect to a host that accepts the
connection and never answers would wait for ever (the connect is bounded like every store operation)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from support.env import PY, ROOT, clean_env
from support.fake_run_loop import FakeProcesses, Recorder
from support.ports import free_ports
from support.waits import wait_for

from supervisor.config import SupervisorConfig
from supervisor.tiers.holdings import NodeInventory
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.diagnosis.evidence import EndedElsewhere
from supervisor.job_identity import JobIdentity
from supervisor.lifecycle import EndReason
from supervisor.cluster.kvstore import OP_TIMEOUT_S, EmbeddedKVStore, StoreUnavailable
from supervisor.membership import Membership
from supervisor.cluster.node_run import NodeRun

JOB = JobIdentity("job-w", "test")
SECRET = b"0123456789abcdef-stall-watch"
HOST = ("import sys, time; from supervisor.cluster.embedded_store import embedded_coordinator; "
        "from supervisor.job_identity import JobIdentity; "
        f"c = embedded_coordinator('127.0.0.1', int(sys.argv[1]), JobIdentity('job-w', 'test'), {SECRET!r}, 0, 2, 60.0); "
        "print('up', flush=True); time.sleep(300)")


class OneNodeEngine:
    """Node 1's replication engine as the watch sees it (nothing is fetched here)."""

    def inventory(self, known: object = None) -> NodeInventory:
        return NodeInventory(1)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``T``: stopped): SIGSTOP lands a little after kill returns."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_the_watch_sees_a_peers_end_after_the_store_stalled(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    host = subprocess.Popen([PY, "-c", HOST, str(port)], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "up"
        peers = ("127.0.0.1:1", "127.0.0.1:2")
        cfg = SupervisorConfig(checkpoint_dir=str(tmp_path / "ckpt"), state_dir=str(tmp_path / "state"),
                               metrics_port=0, poll_interval=0.05, warm_launcher=False, peers=list(peers), node_rank=1)
        member = embedded_coordinator("127.0.0.1", port, JOB, SECRET, 1, 2, 60.0)
        node = NodeRun.from_config(cfg, ["train"], Membership(peers, 1), OneNodeEngine(),  # type: ignore[arg-type]
                                   Recorder(), job=JOB, processes=FakeProcesses(), coordinator=member)
        sup = node.group(member)  # what the node's loop polls
        assert sup.peer_ended(0) is None

        os.kill(host.pid, signal.SIGSTOP)  # the store's host stops answering (a stall, not a refusal)
        wait_for(lambda: process_state(host.pid) == "T", 30, "the store's process to be stopped")
        try:
            assert sup.peer_ended(0) is None  # given up after the operation timeout; the watch goes on
        finally:
            os.kill(host.pid, signal.SIGCONT)
        stalled = member.store
        with pytest.raises(StoreUnavailable, match=f"got no answer within {OP_TIMEOUT_S:.0f}s .* given up"):
            stalled.get("anything")  # the connection the watch used is given up for good

        RoundCoordinator(EmbeddedKVStore("127.0.0.1", port, SECRET, False, 10.0), JOB, SECRET, 0, 2, 60.0).end(0, "node 0: exit 1")
        seen = wait_for(lambda: sup.peer_ended(0), 30, "node 1's watch to see node 0's end once the store answers")
        assert seen == EndedElsewhere(EndReason.PEER_FAILURE, "node 0: exit 1")
        assert member.store is not stalled
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait(timeout=30)
