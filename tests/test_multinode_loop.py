"""MultiNodeSupervisor's loop in-process: one node (rank 1 of 2) over a fake coordinator and replication
engine and the fake process layer of test_run_loop. Covers what only the hooks add: the round number
from the coordinator, a failure elsewhere ending this node's attempt (peer_failure), a round abandoned
before launch, this node's failure and give-up told to the others."""

from __future__ import annotations

from pathlib import Path

from support.fake_run_loop import ATTEMPT, Attempt, FakeProcesses, Recorder, incidents

from supervisor.config import SupervisorConfig
from supervisor.tiers.holdings import FetchResult, NodeInventory, RoundPlan
from supervisor.cluster.coordinator import RoundEnded
from supervisor.job_identity import job_identity
from supervisor.lifecycle import JobStatus
from supervisor.membership import Membership
from supervisor.cluster.multinode import MultiNodeSupervisor

PEERS = ("127.0.0.1:1", "127.0.0.1:2")


class FakeCoordinator:
    """Node 0 as this node sees it through the store: rounds start at ``first_round``; ``end_after``
    polls of round R, ``ended(R)`` names node 0's failure; ``abandon`` rounds end before launch."""

    def __init__(self, first_round: int = 0, end_after: dict[int, int] | None = None,
                 abandon: frozenset[int] = frozenset(), unreadable_fetch: frozenset[int] = frozenset()) -> None:
        self.first_round = first_round
        self.end_after = dict(end_after or {})
        self.abandon = abandon
        self.unreadable_fetch = unreadable_fetch
        self.joined: list[int] = []
        self.ends: list[tuple[int, str]] = []
        self.aborts: list[str] = []
        self.ready: list[int] = []
        self.finished = False
        self.polls: dict[int, int] = {}

    def describe(self) -> str:
        return "fake store"

    def join(self, attempt: int) -> int:
        self.joined.append(max(attempt, self.first_round))
        return self.joined[-1]

    def publish_inventory(self, attempt: int, inventory: NodeInventory) -> None:
        pass

    def plan(self, attempt: int, plan_try: int) -> RoundPlan:
        if attempt in self.abandon:
            raise RoundEnded(f"round {attempt} ended: node 0: fetch failed")
        return RoundPlan(attempt, None, None, {})

    def publish_fetch_result(self, attempt: int, plan_try: int, result: FetchResult) -> None:
        pass

    def fetch_results(self, attempt: int, plan_try: int) -> list[FetchResult]:
        if attempt in self.unreadable_fetch:  # node 0 could not parse its own result: nobody else ends it
            return [FetchResult(error="node 0's fetch result: bad: 'all' is not a list"), FetchResult()]
        return [FetchResult(), FetchResult()]

    def mark_ready(self, attempt: int) -> None:
        self.ready.append(attempt)

    def wait_all_ready(self, attempt: int) -> None:
        """As the store's wait: an attempt ended meanwhile stops it."""
        why = next((w for r, w in self.ends if r == attempt), None)
        if why is not None:
            raise RoundEnded(f"attempt {attempt} ended while waiting for every node to be ready: {why}")

    def ended(self, attempt: int) -> str | None:
        self.polls[attempt] = self.polls.get(attempt, 0) + 1
        if attempt in self.end_after and self.polls[attempt] > self.end_after[attempt]:
            return "node 0: exit_code exit code 1"
        return next((why for r, why in self.ends if r == attempt), None)

    def end(self, attempt: int, reason: str) -> None:
        self.ends.append((attempt, reason))

    def abort(self, reason: str) -> None:
        self.aborts.append(reason)

    def finish(self) -> None:
        self.finished = True


class FakeEngine:
    def inventory(self) -> NodeInventory:
        return NodeInventory(1)

    def fetch(self, step: int, parts: dict) -> None:
        raise AssertionError("nothing to fetch in these plans")


def make(tmp_path: Path, coordinator: FakeCoordinator, *attempts: Attempt, **cfg: object):
    settings = dict(checkpoint_dir=str(tmp_path / "ckpt"), state_dir=str(tmp_path / "state"), metrics_port=0,
                    poll_interval=0.005, backoff_initial=0.01, backoff_max=0.02, backoff_jitter=0.0,
                    heartbeat_timeout=0.3, startup_timeout=0.3, warm_launcher=False, peers=list(PEERS), node_rank=1)
    settings.update(cfg)
    layer, recorder = FakeProcesses(*attempts), Recorder()
    membership = Membership(PEERS, 1)
    job = job_identity("loop-test", settings["checkpoint_dir"], True, peers=PEERS)
    sup = MultiNodeSupervisor(SupervisorConfig(**settings), ["train"], membership,
                              FakeEngine(),  # type: ignore[arg-type]
                              recorder, job=job, coordinator=coordinator, processes=layer)  # type: ignore[arg-type]
    return sup, layer, recorder


def test_round_number_and_env_come_from_the_coordinator(tmp_path: Path) -> None:
    coord = FakeCoordinator(first_round=7)
    sup, layer, rec = make(tmp_path, coord, Attempt(exit_code=0))
    result = sup.run()
    assert result.status is JobStatus.SUCCEEDED and coord.finished and coord.ready == [7]
    env = layer.jobs[0].env
    assert (env["RLSUP_RESTART_COUNT"], env["RLSUP_NODE_RANK"], env["RLSUP_NUM_NODES"]) == ("7", "1", "2")
    assert rec.states == [*ATTEMPT, "succeeded"]


def test_a_failure_on_another_node_ends_this_nodes_attempt(tmp_path: Path) -> None:
    coord = FakeCoordinator(end_after={0: 3})
    sup, layer, rec = make(tmp_path, coord, Attempt(exit_code=None), Attempt(exit_code=0))
    assert sup.run().exit_code == 0
    (inc,) = incidents(tmp_path)
    assert inc["reason"] == "peer_failure" and inc["detail"] == "node 0: exit_code exit code 1"
    assert coord.ends == []  # a peer failure is not echoed back to the store
    assert coord.joined == [0, 1]
    assert layer.jobs[0].grace == 0.0  # this node's job was still running: killed at once, like a crash
    assert rec.states == [*ATTEMPT, "failed", "backoff", *ATTEMPT, "succeeded"]


def test_own_failure_ends_the_round_for_everyone(tmp_path: Path) -> None:
    coord = FakeCoordinator()
    sup, _, _ = make(tmp_path, coord, Attempt(exit_code=3), Attempt(exit_code=0))
    assert sup.run().exit_code == 0
    assert coord.ends == [(0, "node 1: exit_code exit code 3")]


def test_round_abandoned_before_launch_counts_as_peer_failure(tmp_path: Path) -> None:
    coord = FakeCoordinator(abandon=frozenset({0}))
    sup, layer, rec = make(tmp_path, coord, Attempt(exit_code=0))
    assert sup.run().exit_code == 0 and len(layer.jobs) == 1  # nothing launched for round 0
    (inc,) = incidents(tmp_path)
    assert inc["reason"] == "peer_failure" and inc["attempt"] == 0 and "fetch failed" in inc["detail"]
    assert rec.states == ["starting", "failed", "backoff", *ATTEMPT, "succeeded"]  # STARTING -> FAILED
    assert layer.jobs[0].env["RLSUP_RESTART_COUNT"] == "1"


def test_giving_up_is_told_to_the_other_nodes(tmp_path: Path) -> None:
    coord = FakeCoordinator()
    sup, _, _ = make(tmp_path, coord, Attempt(exit_code=5), Attempt(exit_code=5), max_restarts=1)
    result = sup.run()
    assert (result.exit_code, result.status) == (5, JobStatus.GAVE_UP)
    assert coord.aborts == ["node 1: node gave up after attempt 1: give_up"] and not coord.finished


def test_a_node_failing_again_is_named_on_a_multi_node_job(tmp_path: Path) -> None:
    """The repeat-offender rule is the multi-node engine's (a one-node job names no node: test_small_faults)."""
    from supervisor.membership import node_name

    sup, _, _ = make(tmp_path, FakeCoordinator(), Attempt(exit_code=3), Attempt(exit_code=3), Attempt(exit_code=0))
    assert sup.run().exit_code == 0
    first, second = incidents(tmp_path)
    assert first["suspect_nodes"] == [] and second["suspect_nodes"] == [node_name()]
    assert second["verdict"] == f"node {node_name()} failed 2 attempts of this run"


def test_a_fetch_result_that_did_not_parse_ends_the_attempt_before_anyone_launches(tmp_path: Path) -> None:
    """A fetch error only node 0 saw (another node's result did not parse, so that node never ends the
    attempt itself): every node ends it, so nobody launches with no resume step over its checkpoints."""
    coord = FakeCoordinator(unreadable_fetch=frozenset({0}))
    sup, layer, _ = make(tmp_path, coord, Attempt(exit_code=0))
    assert sup.run().exit_code == 0 and len(layer.jobs) == 1  # nothing launched for attempt 0
    assert coord.ends and coord.ends[0][0] == 0 and "fetch failed" in coord.ends[0][1], coord.ends
    assert layer.jobs[0].env["RLSUP_RESTART_COUNT"] == "1"
