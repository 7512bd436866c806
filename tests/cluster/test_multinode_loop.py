"""A node's run in-process (NodeRun: the run loop composed with NodeGroup): one node (rank 1 of 2) over a fake
coordinator and replication engine and the fake process layer of test_run_loop. Covers what the nodes add: the round number
from the coordinator, a failure elsewhere ending this node's attempt (peer_failure), a round abandoned
before launch, this node's failure and give-up told to the others."""

from __future__ import annotations

from pathlib import Path

from support.fake_run_loop import ATTEMPT, Attempt, FakeProcesses, Recorder, incidents

from supervisor.config import SupervisorConfig
from supervisor.tiers.holdings import FetchResult, NodeInventory, RoundPlan
from supervisor.cluster.round_errors import RoundEnded
from supervisor.job_identity import job_identity
from supervisor.lifecycle import EndReason, JobStatus
from supervisor.membership import Membership
from supervisor.cluster.node_run import NodeRun

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

    def ending(self, attempt: int) -> tuple[str, EndReason] | None:
        """As the store's: every end here is a failure (the grow-back end is tests/cluster/test_shrink_round.py's)."""
        why = self.ended(attempt)
        return None if why is None else (why, EndReason.PEER_FAILURE)

    def end(self, attempt: int, reason: str) -> None:
        self.ends.append((attempt, reason))

    def abort(self, reason: str) -> None:
        self.aborts.append(reason)

    def finish(self, attempt: int) -> None:
        self.finished = True


class FakeEngine:
    membership = Membership(PEERS, 1)  # the peers as the engine knows them (a spare's endpoint once it took a rank)

    def inventory(self, known: object = None) -> NodeInventory:
        return NodeInventory(1)

    def fetch(self, step: int, parts: dict) -> None:
        raise AssertionError("nothing to fetch in these plans")


def make(tmp_path: Path, coordinator: FakeCoordinator, *attempts: Attempt, stop: object = None, engine: object = None,
         **cfg: object):
    """``engine``: this node's replication engine (default: a fake one that holds nothing)."""
    settings = dict(checkpoint_dir=str(tmp_path / "ckpt"), state_dir=str(tmp_path / "state"), metrics_port=0,
                    poll_interval=0.005, backoff_initial=0.01, backoff_max=0.02, backoff_jitter=0.0,
                    heartbeat_timeout=0.3, startup_timeout=0.3, warm_launcher=False, peers=list(PEERS), node_rank=1)
    settings.update(cfg)
    layer, recorder = FakeProcesses(*attempts), Recorder()
    membership = Membership(PEERS, 1)
    job = job_identity("loop-test", settings["checkpoint_dir"], True, peers=PEERS)
    sup = NodeRun.from_config(SupervisorConfig(**settings), ["train"], membership,
                              engine or FakeEngine(),  # type: ignore[arg-type]
                              recorder, job=job, coordinator=coordinator, processes=layer,
                              stop=stop)  # type: ignore[arg-type]
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


class InventoryCoordinator(FakeCoordinator):
    """Keeps what this node publishes as its holdings, by attempt."""

    def __init__(self) -> None:
        super().__init__()
        self.inventories: dict[int, NodeInventory] = {}

    def publish_inventory(self, attempt: int, inventory: NodeInventory) -> None:
        self.inventories[attempt] = inventory


def _restart_over_own_parts(tmp_path: Path, monkeypatch, between=None):  # type: ignore[no-untyped-def]
    """Attempt 0 fails over this node's parts (rank 1 of 2) of steps 5 and 10, saved an hour ago; attempt 1
    succeeds; ``between`` runs after deciding, before the round. What the restart hashed (attempt 0 running to
    attempt 1 running), and the holdings this node published for attempt 1."""
    from collections import Counter

    from supervisor.tiers.replication import ReplicationEngine
    from support.files import count_hashes, saved_step

    ckpt = tmp_path / "ckpt"
    for step in (5, 10):
        saved_step(ckpt, step, range(1, 2), 2, node_rank=1)
    engine = ReplicationEngine(membership=Membership(PEERS, 1), checkpoint_dir=ckpt, replica_root=tmp_path / "replicas",
                               clients={}, state_path=tmp_path / "replication.json",
                               job=job_identity("loop-test", str(ckpt), True, peers=PEERS).id)
    counts, restart_counts, coord = count_hashes(monkeypatch), Counter[str](), InventoryCoordinator()
    sup, layer, rec = make(tmp_path, coord, Attempt(exit_code=3, on_tick=(1, counts.clear)),
                           Attempt(exit_code=0, on_tick=(1, lambda: restart_counts.update(counts))), engine=engine)
    if between is not None:
        rec.on_state["backoff"] = between
    assert sup.run().exit_code == 0 and len(layer.jobs) == 2
    return restart_counts, coord.inventories[1]


def test_a_restart_hashes_this_nodes_newest_parts_once(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 42, choose once per failure (one node's count: test_verify_once.py): the progress marker verifies this
    node's newest part in full (the one rule, supervisor.tiers.resume.newest_step) and the round's inventory reuses
    its checksum; the older step's part, not verified by the marker, is hashed by the inventory, once."""
    counts, held = _restart_over_own_parts(tmp_path, monkeypatch)
    assert counts == {"step_000000010/rank_00001.pt": 1, "step_000000005/rank_00001.pt": 1}
    assert sorted(held.steps) == [5, 10]


def test_a_part_changed_between_deciding_and_the_round_is_verified_again(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """This node's part of step 10, rewritten in place after the marker verified it (same size, other bytes), is
    hashed again by the inventory and not offered to the round."""
    def corrupt() -> None:
        path = tmp_path / "ckpt" / "step_000000010" / "rank_00001.pt"
        path.write_bytes(bytes(len(path.read_bytes())))

    counts, held = _restart_over_own_parts(tmp_path, monkeypatch, between=corrupt)
    assert counts == {"step_000000010/rank_00001.pt": 2, "step_000000005/rank_00001.pt": 1}
    assert sorted(held.steps) == [5]


# ------------------------------------------------------------ the loop composes; node 0 plans once


def test_no_class_in_supervisor_subclasses_the_run_loop() -> None:
    """The nodes are the loop's collaborator (supervisor.run.peers.Peers), never a subclass of it."""
    import ast

    root = Path(__file__).resolve().parents[2] / "supervisor"
    subclasses = [f"{path.relative_to(root)}:{node.name}" for path in sorted(root.rglob("*.py"))
                  for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                  and any(getattr(b, "id", getattr(b, "attr", None)) == "Supervisor" for b in node.bases)]
    assert subclasses == []


def test_the_stop_handlers_are_installed_once(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Given the command line's stop (its handlers installed there), a node's run installs none; without one, it
    installs its own once (the loop inside it none)."""
    from supervisor.stop_request import StopRequest

    installs: list[StopRequest] = []
    real = StopRequest.install
    monkeypatch.setattr(StopRequest, "install", lambda self: installs.append(self) or real(self))
    sup, _, _ = make(tmp_path / "own", FakeCoordinator(), Attempt(exit_code=0))
    assert sup.run().exit_code == 0 and installs == [sup.stop]
    installs.clear()
    given = StopRequest(sup.stop.preempt_signal)
    sup, _, _ = make(tmp_path / "given", FakeCoordinator(), Attempt(exit_code=0), stop=given)
    assert sup.stop is given and sup.run().exit_code == 0 and installs == []


class FakeTier:
    """Node 0's persistent tier as the planner reads it: ``offers`` by step, newest first as part_listing lists."""

    location = "fake://tier"

    def __init__(self, offers: dict) -> None:
        import types

        self.offers, self.protected, self.listed = offers, [], []
        self.reads = types.SimpleNamespace(call=lambda fn, default: fn())

    def stalled(self) -> None:
        return None

    def part_listing(self, newer_than: int | None = None, exclude: object = frozenset()) -> dict:
        self.listed.append(newer_than)
        return {s: o for s, o in self.offers.items() if newer_than is None or s > newer_than}

    def protect(self, step: int | None) -> None:
        self.protected.append(step)


class InventoryStore:
    first_round = False
    node_rank = 0

    def __init__(self, inventories: list[NodeInventory]) -> None:
        self.inventories_ = inventories
        self.num_nodes = len(inventories)
        self.published: list[tuple[int, RoundPlan]] = []

    def inventories(self, attempt: int) -> list[NodeInventory]:
        return self.inventories_

    def publish_plan(self, plan: RoundPlan, plan_try: int = 0) -> None:
        self.published.append((plan_try, plan))


def _planned_steps(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    from supervisor.cluster import round_plan

    steps: list[int] = []
    real = round_plan._plan_step

    def counting(step: int, *args: object) -> object:
        steps.append(step)
        return real(step, *args)  # type: ignore[arg-type]
    monkeypatch.setattr(round_plan, "_plan_step", counting)
    return steps


def test_node_0_plans_each_step_once_with_the_persistent_tiers_newer_steps(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Step 4 is complete in the nodes' own parts, steps 6 and 8 only in the tier (8 incomplete there): the plan is
    step 6 from the tier, and no step is planned twice (the tier is listed only above the nodes' own step)."""
    from supervisor.cluster.round_lead import RoundLead, RoundMember, round_role
    from supervisor.tiers.holdings import PERSISTENT_HOLDER, StepHoldings, TierOffer

    steps = _planned_steps(monkeypatch)
    own = [NodeInventory(0, {4: StepHoldings(2, {0: 0})}), NodeInventory(1, {4: StepHoldings(2, {1: 1})})]
    tier = FakeTier({8: TierOffer(2, frozenset({0})), 6: TierOffer(2, frozenset({0, 1}), {0: 0, 1: 1})})
    store = InventoryStore(own)
    lead = round_role(0, store, tier, lambda line: None)  # type: ignore[arg-type]
    assert isinstance(lead, RoundLead) and isinstance(round_role(1, store, tier, print), RoundMember)  # type: ignore[arg-type]
    lead.publish_plan(3, 0, set())
    ((plan_try, plan),) = store.published
    assert (plan_try, plan.step) == (0, 6) and plan.fetch == {0: {0: [PERSISTENT_HOLDER]}, 1: {1: [PERSISTENT_HOLDER]}}
    assert sorted(steps) == [4, 6, 8] and tier.listed == [4] and tier.protected == [6]


def test_node_0_keeps_the_nodes_own_step_when_the_tier_has_no_complete_newer_one(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from supervisor.cluster.round_lead import RoundLead
    from supervisor.tiers.holdings import StepHoldings, TierOffer

    steps = _planned_steps(monkeypatch)
    own = [NodeInventory(0, {4: StepHoldings(2, {0: 0})}), NodeInventory(1, {4: StepHoldings(2, {1: 1})})]
    tier = FakeTier({8: TierOffer(2, frozenset({0}))})
    lead = RoundLead(InventoryStore(own), tier, lambda line: None)  # type: ignore[arg-type]
    plan = lead.plan(3, set())
    assert plan.step == 4 and plan.fetch == {} and sorted(steps) == [4, 8] and tier.protected == [4]
    lead.note_bad({(4, 1)})  # a persistent part that failed verification is never offered again
    assert lead.bad_persistent == {(4, 1)}


def test_only_the_lead_owes_the_job_s_end_and_only_node_0_hosts_the_embedded_store() -> None:
    """Node 0's end-of-run duties are its role's (supervisor.cluster.round_lead), not a rank test in the node's run:
    the lead records the job's end for a node cut off until now and sets the spares' cue; a member does neither.
    The embedded store lives in node 0's rlsup; an etcd store in nobody's."""
    from supervisor.cluster.job_store import CoordinatorSettings
    from supervisor.cluster.round_lead import round_role
    from supervisor.cluster.spares import DONE_KEY

    class Keys:
        def __init__(self) -> None:
            self.set_: dict[str, str] = {}

        def set(self, key: str, value: str) -> None:
            self.set_[key] = value

    class Coordinator:
        keys = Keys()
        node_rank = 0

    class JobEnd:
        recorded: list[tuple[int, int]] = []

        def record(self, node: int, attempt: int) -> None:
            self.recorded.append((node, attempt))

    member_store, lead_store, job_end = Coordinator(), Coordinator(), JobEnd()
    member_store.keys, lead_store.keys = Keys(), Keys()
    round_role(2, member_store, None, print).finish_job(job_end, 4)  # type: ignore[arg-type]
    assert member_store.keys.set_ == {} and job_end.recorded == []
    round_role(0, lead_store, None, print).finish_job(job_end, 4)  # type: ignore[arg-type]
    assert lead_store.keys.set_ == {DONE_KEY: "1"} and job_end.recorded == [(0, 4)]
    round_role(0, Coordinator(), None, print).finish_job(None, 4)  # type: ignore[arg-type]  # a job without spares
    embedded, etcd = CoordinatorSettings(), CoordinatorSettings(backend="etcd")
    assert embedded.hosted_by(0) and not embedded.hosted_by(1) and not etcd.hosted_by(0)
