"""A spare whose node 0 is lost before the spare's first connect got in (issue 31; found in a whole-suite run).

Seen: a spare started while node 0's store came up; torch's client connect then hung in a reverse lookup
(this machine's resolver drops queries) until node 0 was SIGKILLed; the spare went on waiting for the whole
``rendezvous_timeout``, exited 1 ("cannot reach the coordination store"), and the job failed instead of the spare
hosting the store. Here node 0 stands as a port that accepts and says nothing (torch's connect fails there as it
did), then goes away: the spare must host the store on node 0's address and take node rank 0, and a plain connect
must raise :class:`StoreGone` after ``gone_after_s``, not wait out its window.

In process, with a real embedded store and real sockets.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from supervisor import exit_codes
from supervisor.config import SupervisorConfig
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.endpoint_probe import connect_refused
from supervisor.job_identity import JobIdentity
from supervisor.cluster.kvstore import StoreGone, connect_store
from supervisor.membership import Membership
from supervisor.cluster.job_store import connect_coordinator
from supervisor.observer import Observer
from supervisor.processes.layer import Processes
from supervisor.cluster.spare_run import SpareRun, SpareSettings
from supervisor.cluster.spares import JobEnd, Roster, SpareSeat, write_job_end
from supervisor.stop_request import StopRequest
from supervisor.launch.warm_start import WarmStarts
from support.ports import free_port

JOB = JobIdentity("job-first-connect", "test")
SECRET = b"0123456789abcdef-shared"
WINDOW_S = 120.0  # the connect's own window (rendezvous_timeout): the store's loss must end it long before


class SilentNode0:
    """A listener that accepts and never answers: the port answers, torch's handshake does not complete."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = threading.Event()
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # lost
            self.held.append(conn)
            self.accepted.set()

    def lose(self) -> None:
        """Node 0 is SIGKILLed: its port refuses from now on."""
        for conn in self.held:
            conn.close()
        self.sock.close()


def lost_once_seen(node0: SilentNode0, before: Callable[[], None] = lambda: None) -> None:
    """Loses node 0 once a client reached its port (in a thread: the connect under test runs meanwhile), after
    ``before`` (what node 0 did last)."""
    def run() -> None:
        if node0.accepted.wait(60):
            before()
            node0.lose()
    threading.Thread(target=run, daemon=True).start()


def test_a_store_that_answered_and_went_away_raises_store_gone_not_the_whole_window() -> None:
    node0 = SilentNode0()
    lost_once_seen(node0)
    with pytest.raises(StoreGone, match="answered, then nothing listened"):
        connect_store("127.0.0.1", node0.port, SECRET, WINDOW_S, None, gone_after_s=1.0)


def survivor() -> socket.socket:
    """A job node that is still there: its endpoint accepts (what the spare checks before it hosts)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


def spare_config(tmp_path: Path, store_port: int, others: list[int]) -> SupervisorConfig:
    """A spare's config (node rank 3 of 3 + 1): node 0's store at ``store_port``, nodes 1 and 2 at ``others``."""
    peers = [f"127.0.0.1:{p}" for p in (store_port, *others, 3)]
    return SupervisorConfig(peers=peers, node_rank=3, spares=1, coordinator_port=store_port, spare_takeover_s=0.5,
                            rendezvous_timeout=WINDOW_S, state_dir=str(tmp_path / "state"),
                            checkpoint_dir=str(tmp_path / "ckpt"), metrics_port=0, warm_launcher=False)


def spare_after_node_0(tmp_path: Path, node0: SilentNode0, others: list[int], before: Callable[[], None] = lambda: None
                       ) -> tuple[int, list[tuple[Membership, bool]], list[str]]:
    """Runs a spare (node rank 3) whose node 0 is lost once the spare reached it, after ``before``; nodes 1 and 2
    at ``others``."""
    cfg = spare_config(tmp_path, node0.port, others)
    peers = list(cfg.peers)
    taken: list[tuple[Membership, bool]] = []

    def run_node(membership: Membership, seat: SpareSeat, hosted: RoundCoordinator | None, warm: WarmStarts,
                 processes: Processes) -> int:
        taken.append((membership, hosted is not None))
        return 0

    def connect(view: Membership, stop: StopRequest, gone_after_s: float, wait_s: float | None) -> RoundCoordinator:
        return connect_coordinator(cfg, view, JOB, SECRET, stop, gone_after_s, wait_s)

    lost_once_seen(node0, before)
    spare = SpareRun(SpareSettings.from_config(cfg, 3, JOB.id), Roster(tuple(peers), 1), 3, JOB, SECRET, connect,
                     StopRequest(signal.SIGUSR1), Observer())
    return spare.run(run_node), taken, peers


def test_a_spare_hosts_the_store_when_node_0_is_lost_before_its_first_connect(tmp_path: Path) -> None:
    node0 = SilentNode0()
    with survivor() as node1, survivor() as node2:
        code, taken, peers = spare_after_node_0(tmp_path, node0, [node1.getsockname()[1], node2.getsockname()[1]])
    assert code == 0
    assert len(taken) == 1, taken
    membership, hosted = taken[0]
    assert hosted, "the spare took a slot without hosting node 0's store"
    assert membership.node_rank == 0 and membership.peers[0] == peers[3], membership


def test_a_spare_hosts_nothing_when_the_whole_job_is_gone(tmp_path: Path) -> None:
    """Node 0's store gone and nodes 1 and 2 refusing too: the job ended (review finding: the spare hosted a fresh
    store, took node rank 0 of a job with nobody left, and exited 1 after its window). It takes no rank. Nothing
    says the job finished (its nodes may have given up: 76, 1), so it exits 1, never 0, which the SLURM recipe reads
    as the job's success (review finding, issue 41); tests/deploy/test_sbatch_spares.py has what the script answers."""
    node0 = SilentNode0()
    code, taken, _ = spare_after_node_0(tmp_path, node0, [free_port(), free_port()])
    assert (code, taken) == (exit_codes.FAILED, [])
    assert connect_refused(f"127.0.0.1:{node0.port}"), "the spare hosted a store for nobody"


def test_a_spare_that_finds_the_job_s_end_recorded_exits_0(tmp_path: Path) -> None:
    """As above, but node 0 recorded the job's end (supervisor.cluster.spares.JobEnd) in the shared checkpoint directory
    before it went: the job finished without the spare, which exits 0."""
    node0 = SilentNode0()

    def record_end() -> None:
        write_job_end((tmp_path / "ckpt",), JobEnd(JOB.id, 0, 2, time.time()), SECRET, JOB)

    code, taken, _ = spare_after_node_0(tmp_path, node0, [free_port(), free_port()], record_end)
    assert (code, taken) == (exit_codes.OK, [])


def test_a_spare_takes_an_earlier_run_s_record_for_nothing(tmp_path: Path) -> None:
    """A record of an earlier run of the same job (written before this spare started) is not this run's end."""
    write_job_end((tmp_path / "ckpt",), JobEnd(JOB.id, 0, 2, time.time() - 60), SECRET, JOB)
    code, taken, _ = spare_after_node_0(tmp_path, SilentNode0(), [free_port(), free_port()])
    assert (code, taken) == (exit_codes.FAILED, [])


NODE_0 = """
import sys, time
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.job_identity import JobIdentity
hosted = embedded_coordinator("127.0.0.1", int(sys.argv[1]), JobIdentity("job-first-connect", "test"),
                              b"0123456789abcdef-shared", 0, 3, 30)
print("hosting", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def node_0_and_two_survivors() -> Iterator[tuple[subprocess.Popen, int, list[int]]]:
    """Node 0 hosting the job's store (a real process; its port), and nodes 1 and 2 standing as endpoints that
    accept (their ports); all gone after."""
    port = free_port()
    node0 = subprocess.Popen([sys.executable, "-c", NODE_0, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert node0.stdout is not None and node0.stdout.readline().strip() == "hosting"
        with survivor() as node1, survivor() as node2:
            yield node0, port, [node1.getsockname()[1], node2.getsockname()[1]]
    finally:
        node0.kill()
        node0.wait(30)


def test_node_0_stalled_before_the_first_attempt_the_spare_goes_on_watching(tmp_path: Path) -> None:
    """Review finding: the spare gave up (exit 75) on the first store timeout before the first attempt, while the
    job's nodes give node 0 LIVENESS_LAPSE_S; node 0 stopped (SIGSTOP) for 7 s and then resumed kept its job and
    lost its spare. The spare must still be watching after node 0 resumes, and stop cleanly when asked."""
    with node_0_and_two_survivors() as (node0, port, others):
        cfg = spare_config(tmp_path, port, others)
        connects: list[float] = []

        def connect(view: Membership, stop: StopRequest, gone_after_s: float, wait_s: float | None) -> RoundCoordinator:
            coordinator = connect_coordinator(cfg, view, JOB, SECRET, stop, gone_after_s, wait_s)
            connects.append(time.monotonic())
            return coordinator

        stop = StopRequest(signal.SIGUSR1)
        spare = SpareRun(SpareSettings.from_config(cfg, 3, JOB.id), Roster(tuple(cfg.peers), 1), 3, JOB, SECRET,
                         connect, stop, Observer())
        result: list[int] = []
        runner = threading.Thread(target=lambda: result.append(spare.run(lambda *_: 0)), daemon=True)
        runner.start()
        deadline = time.monotonic() + 30
        while not connects:
            assert time.monotonic() < deadline, "the spare never reached node 0's store"
            time.sleep(0.05)
        node0.send_signal(signal.SIGSTOP)
        time.sleep(7.0)  # the stall itself is the subject: the spare's store calls time out meanwhile
        node0.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while len(connects) < 2:  # it reconnected after the stall and watches again
            assert not result, f"the spare ended ({result}) during node 0's stall"
            assert time.monotonic() < deadline, "the spare did not reconnect after node 0 resumed"
            time.sleep(0.05)
        stop.ask(signal.SIGTERM)
        runner.join(30)
        assert result and result[0] != exit_codes.REQUEUE, result


def test_node_0_stalled_then_lost_before_the_first_attempt_the_spare_still_requeues(tmp_path: Path) -> None:
    """Node 0 hosts the store (a real process), the spare watches it, no attempt has started; node 0 stops, the
    spare's store calls fail, and node 0 is SIGKILLed as the spare reconnects. Every node answers a loss in the
    first round with exit 75 (docs/deploy.md). Review findings: the spare hosted a fresh store and took node rank 0
    within seconds; then, after a stall, it reconnected with its whole rendezvous window, and a node 0 killed during
    that reconnect sent it down the same path. The lapse is one deadline from the store's first failure: the spare
    must exit 75 and host nothing."""
    with node_0_and_two_survivors() as (node0, port, others):
        cfg = spare_config(tmp_path, port, others)
        taken: list[Membership] = []
        watching = threading.Event()

        def connect(view: Membership, stop: StopRequest, gone_after_s: float, wait_s: float | None) -> RoundCoordinator:
            if wait_s is not None and node0.poll() is None:  # the reconnect after the stall: node 0 dies now
                node0.send_signal(signal.SIGKILL)
                node0.wait(30)
            coordinator = connect_coordinator(cfg, view, JOB, SECRET, stop, gone_after_s, wait_s)
            watching.set()
            return coordinator

        def run_node(membership: Membership, *_: object) -> int:
            taken.append(membership)
            return 0

        stop = StopRequest(signal.SIGUSR1)
        spare = SpareRun(SpareSettings.from_config(cfg, 3, JOB.id), Roster(tuple(cfg.peers), 1), 3, JOB, SECRET,
                         connect, stop, Observer())
        result: list[int] = []
        runner = threading.Thread(target=lambda: result.append(spare.run(run_node)), daemon=True)
        runner.start()
        assert watching.wait(30), "the spare never reached node 0's store"
        node0.send_signal(signal.SIGSTOP)
        runner.join(60)
        assert result == [exit_codes.REQUEUE] and taken == [], (result, taken)
        assert connect_refused(f"127.0.0.1:{port}"), "the spare hosted node 0's store"
