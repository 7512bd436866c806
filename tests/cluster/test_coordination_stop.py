"""A stop asked while a node waits for the others ends the wait at once, in every wait of the coordination
(in-process, through a real embedded store): the connect to a store nobody hosts yet, node 0 waiting for the other
nodes to join (a peer that never started), a node waiting for node 0 to open the first attempt, for the
plan, for every node's fetch, for all to be ready, and the reconnect after node 0's store is lost. Also
a node that refuses to start for a clash: its ``abort`` ends the others' waits, as a clash.

The rendezvous timeout is 300 s everywhere; each wait must end within :data:`PROMPT_S`, a deadline on
the wait (a thread join), never a timed assertion. The stop is asked from inside the wait, at its third
poll (:class:`StopWhenWaiting`), so the test never guesses when the node is waiting."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Callable

import pytest

from support.fake_run_loop import FakeProcesses, Recorder
from support.waits import in_thread, wait_for

from supervisor import exit_codes
from supervisor.config import SupervisorConfig
from supervisor.tiers.holdings import FetchResult, NodeInventory
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.round_errors import CoordinationError, JobClash
from supervisor.cluster.round_plan import compute_plan
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.job_identity import JobIdentity
from supervisor.lifecycle import EndReason, JobStatus
from supervisor.membership import Membership
from supervisor.cluster.node_run import NodeRun
from supervisor.run.record import RunResult
from supervisor.stop_request import StopAsked, StopRequest
from support.ports import free_port

JOB = JobIdentity("job-s", "test")
SECRET = b"0123456789abcdef-shared"
TIMEOUT_S = 300.0  # rendezvous_timeout: no wait here may come near it
PROMPT_S = 30.0  # the deadline on each wait's end


class StopWhenWaiting(StopRequest):
    """The run's stop request, asked (as its signal handler would) at the third poll of a wait whose
    description contains ``what``: the stop lands while the node is inside that wait."""

    def __init__(self, what: str, signum: signal.Signals = signal.SIGTERM, preempted: bool = False,
                 at: int = 3) -> None:
        super().__init__(signal.SIGUSR1)
        self.what, self.stop_signal, self.stop_preempted, self.at = what, signum, preempted, at
        self.polls = 0
        self.seen: list[str] = []

    def check(self, waiting_for: str) -> None:
        self.seen.append(waiting_for)
        if self.what in waiting_for:
            self.polls += 1
            if self.polls == self.at:
                self.ask(self.stop_signal, self.stop_preempted)
        super().check(waiting_for)


def node(port: int, rank: int, stop: StopRequest | None = None, nodes: int = 2) -> RoundCoordinator:
    return embedded_coordinator("127.0.0.1", port, JOB, SECRET, rank, nodes, TIMEOUT_S, stop)


def ends_with(wait: Callable[[], object]) -> BaseException:
    """Run ``wait`` in a thread; the exception it ended with (it must end within PROMPT_S)."""
    return ends_with_later(wait)()


def assert_stopped(e: BaseException, what: str, code: int = 128 + signal.SIGTERM,
                   reason: EndReason = EndReason.STOPPED) -> None:
    assert isinstance(e, StopAsked), repr(e)
    assert e.exit_code == code and e.reason == reason, (e.exit_code, e.reason)
    assert "asked to stop" in str(e) and what in str(e), str(e)


def test_node_0_waiting_for_a_peer_that_never_started() -> None:
    stop = StopWhenWaiting("every node to join")
    leader = node(free_port(), 0, stop)
    e = ends_with(lambda: leader.join(0))
    assert_stopped(e, "every node to join")
    assert "(SIGTERM)" in str(e)


def test_a_node_waiting_for_node_0_to_open_the_first_attempt_is_preempted() -> None:
    port = free_port()
    leader = node(port, 0, nodes=3)  # hosts the store; node 2 never comes, so node 0 never opens the attempt
    stop = StopWhenWaiting("node 0 to open the first attempt", signal.SIGUSR1, preempted=True)
    member = node(port, 1, stop, nodes=3)
    e = ends_with(lambda: member.join(0))
    assert_stopped(e, "node 0 to open the first attempt", exit_codes.REQUEUE, EndReason.PREEMPTED)
    assert "SIGUSR1, preemption" in str(e)
    assert leader.store.get("rlsup/job-s/base") is None


def test_the_round_waits_plan_fetch_and_ready() -> None:
    port = free_port()
    leader, member = node(port, 0), node(port, 1)
    both: dict[int, int] = {}
    threads = [threading.Thread(target=lambda c=c, i=i: both.__setitem__(i, c.join(0)))
               for i, c in enumerate((leader, member))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROMPT_S)
    assert both == {0: 0, 1: 0}

    # The plan: node 0 never publishes it.
    member.stop = StopWhenWaiting("the plan of attempt 0")
    assert_stopped(ends_with(lambda: member.plan(0)), "the plan of attempt 0")

    # Every node's fetch (node 0) and node 0's summary of them (node 1): nobody else publishes.
    leader.publish_inventory(0, NodeInventory(0))
    member.publish_inventory(0, NodeInventory(1))
    leader.publish_plan(compute_plan(0, leader.inventories(0)))
    leader.stop = StopWhenWaiting("every node's fetch in attempt 0")
    assert_stopped(ends_with(lambda: leader.fetch_results(0, 0)), "every node's fetch in attempt 0")
    member.stop = StopWhenWaiting("node 0's summary of every node's fetch")
    assert_stopped(ends_with(lambda: member.fetch_results(0, 0)), "summary of every node's fetch in attempt 0")

    # All ready: node 0 waits for node 1's mark, node 1 for node 0's "all ready".
    leader.publish_fetch_result(0, 0, FetchResult())
    leader.mark_ready(0)
    leader.stop = StopWhenWaiting("all nodes ready for attempt 0")
    assert_stopped(ends_with(lambda: leader.wait_all_ready(0)), "all nodes ready for attempt 0")
    member.stop = StopWhenWaiting("node 0 to see all nodes ready")
    assert_stopped(ends_with(lambda: member.wait_all_ready(0)), "node 0 to see all nodes ready for attempt 0")


def test_the_reconnect_wait_after_node_0_is_lost() -> None:
    port = free_port()
    leader = node(port, 0, nodes=1)
    assert leader.join(0) == 0
    stop = StopWhenWaiting("to answer")
    member = embedded_coordinator("127.0.0.1", port, JOB, SECRET, 1, 2, TIMEOUT_S, stop)
    leader.store.close()  # node 0's supervisor is gone, and with it the store it hosted
    del leader
    assert_stopped(ends_with(lambda: member.join(1)), "(node 0) to answer")


def test_a_stop_asked_before_a_wait_ends_it_before_its_first_look() -> None:
    stop = StopRequest(signal.SIGUSR1)
    stop.ask(signal.SIGINT)
    leader = node(free_port(), 0, stop)
    assert_stopped(ends_with(lambda: leader.join(0)), "every node to join", 128 + signal.SIGINT)


def ends_with_later(wait: Callable[[], object]) -> Callable[[], BaseException]:
    """Start ``wait`` in a thread now; the returned call waits (PROMPT_S) for the exception it ended with."""
    ended = in_thread(wait, PROMPT_S)

    def result() -> BaseException:
        out = ended()
        assert isinstance(out, BaseException), f"the wait returned {out!r} instead of ending on the stop"
        return out
    return result


@pytest.mark.parametrize("signum, preempted, code", [(signal.SIGTERM, False, 143), (signal.SIGUSR1, True, 75)])
def test_the_stop_request_names_the_signal_and_the_wait(signum: signal.Signals, preempted: bool, code: int) -> None:
    stop = StopRequest(signal.SIGUSR1)
    stop.check("anything")  # nobody asked: nothing happens
    stop.ask(signum, preempted)
    with pytest.raises(StopAsked) as e:
        stop.check("every node to join")
    assert e.value.exit_code == code
    assert str(e.value) == f"rlsup was asked to stop ({signum.name}{', preemption' if preempted else ''}) " \
                           "while waiting for every node to join"


class OneNodeEngine:
    """Node 1's replication engine as the round sees it: an empty inventory, nothing to fetch."""

    def inventory(self, known: object = None) -> NodeInventory:
        return NodeInventory(1)


def test_a_stop_in_a_round_is_recorded_as_a_stop_and_ends_the_attempt_for_the_others(tmp_path: Path) -> None:
    """Node 1's whole loop (NodeRun over a real store, fake processes): node 0 joins but never
    plans; SIGTERM while node 1 waits for the plan ends the run at once, 143, the attempt recorded as
    stopped, nothing launched, and ``end/0`` tells node 0 why."""
    port = free_port()
    leader = node(port, 0)
    peers = ("127.0.0.1:1", "127.0.0.1:2")
    cfg = SupervisorConfig(checkpoint_dir=str(tmp_path / "ckpt"), state_dir=str(tmp_path / "state"), metrics_port=0,
                           poll_interval=0.005, warm_launcher=False, peers=list(peers), node_rank=1)
    layer, recorder = FakeProcesses(), Recorder()
    sup = NodeRun.from_config(cfg, ["train"], Membership(peers, 1), OneNodeEngine(),  # type: ignore[arg-type]
                              recorder, job=JOB, processes=layer,  # type: ignore[arg-type]
                              connect=lambda stop: embedded_coordinator("127.0.0.1", port, JOB, SECRET, 1, 2,
                                                                        TIMEOUT_S, stop))
    threading.Thread(target=lambda: leader.join(0), daemon=True).start()  # node 0 joins, then never plans

    def stop_once_waiting_for_the_plan() -> None:
        wait_for(lambda: leader.store.get("rlsup/job-s/inv/0/1") is not None, PROMPT_S, "node 1's inventory")
        sup.request_stop(signal.SIGTERM)

    threading.Thread(target=stop_once_waiting_for_the_plan, daemon=True).start()
    results: list[RunResult] = []
    run = threading.Thread(target=lambda: results.append(sup.run()), daemon=True)
    run.start()
    run.join(PROMPT_S * 2)
    assert not run.is_alive() and results, "node 1's run did not end on the stop"
    (result,) = results
    assert (result.exit_code, result.status) == (143, JobStatus.STOPPED)
    assert recorder.states == ["starting", "stopped"] and layer.jobs == []
    (incident,) = result.incidents
    assert incident.reason == EndReason.STOPPED and "(SIGTERM) while waiting for the plan of attempt 0" in incident.detail
    assert "node 1: rlsup was asked to stop (SIGTERM)" in (leader.ended(0) or "")


@pytest.mark.parametrize("running", [False, True])
def test_a_refusing_node_tells_a_job_still_joining_but_not_one_that_runs(tmp_path: Path, running: bool) -> None:
    """The half clash (nobody planned yet: node 0 waits in its first join) is told; a second rlsup started for
    a node of a job that already runs refuses alone, and the running job's next join is not aborted."""
    from supervisor.cluster.store_host import claim_store
    from supervisor.cluster.clash_notice import tell_job_refused
    from supervisor.cluster.job_store import CoordinatorSettings
    from supervisor.transport.security import TransportSecurity

    port = free_port()
    leader = node(port, 0)
    claim_store(leader.keys, leader.job)
    if running:
        leader.keys.create("base", "0")  # the nodes agreed on attempt 0: the job runs
    token = tmp_path / "token"
    token.write_bytes(SECRET)
    token.chmod(0o600)
    peers = ["127.0.0.1:1", "127.0.0.1:2"]
    cfg = SupervisorConfig(peers=peers, node_rank=1, coordinator_port=port, token_file=str(token))
    told = tell_job_refused(CoordinatorSettings.from_config(cfg), TransportSecurity.from_config(cfg),
                            Membership(tuple(peers), 1), JOB, "state_dir /x is in use by rlsup job 'job-s'")
    assert (told is None) == running
    assert (leader.keys.get("abort") is None) == running


@pytest.mark.parametrize("error", [JobClash("the store on 127.0.0.1:1 belongs to job other"),
                                   CoordinationError("timed out after 1s waiting for node 0")])
def test_a_store_never_reached_records_nothing_and_lingers_not(tmp_path: Path, error: CoordinationError,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Nothing ran, so nothing is recorded: a predecessor's state (rlsup died mid-attempt 5) stays for the next
    start to read as lost, and node 0 refused for a clash does not keep a store up that it never hosted."""
    peers = ("127.0.0.1:1", "127.0.0.1:2")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    predecessor = '{"state": "running", "attempt": 5}'
    (state_dir / "state.json").write_text(predecessor)
    cfg = SupervisorConfig(checkpoint_dir=str(tmp_path / "ckpt"), state_dir=str(state_dir), metrics_port=0,
                           poll_interval=0.005, warm_launcher=False, peers=list(peers), node_rank=0)

    def refused(stop: StopRequest) -> RoundCoordinator:
        raise error

    sup = NodeRun.from_config(cfg, ["train"], Membership(peers, 0), OneNodeEngine(),  # type: ignore[arg-type]
                              Recorder(), job=JOB, processes=FakeProcesses(), connect=refused)  # type: ignore[arg-type]
    with caplog.at_level("INFO"), pytest.raises(type(error)):
        sup.run()
    assert (state_dir / "state.json").read_text() == predecessor
    assert "keeping the store up" not in caplog.text and "gave up" not in caplog.text, caplog.text
