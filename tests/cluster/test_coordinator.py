"""Attempt coordination through a real embedded store, and the resume plan across nodes' inventories."""

from __future__ import annotations

import threading

import pytest

from supervisor.tiers.holdings import PERSISTENT_HOLDER, FetchResult, NodeInventory, StepHoldings, TierOffer
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.round_errors import CoordinationError, JobClash
from supervisor.cluster.round_plan import compute_plan
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.job_identity import JobIdentity
from support.ports import free_port

JOB = JobIdentity("job-a", "test")
SECRET = b"0123456789abcdef-shared"


def node(port: int, rank: int, nodes: int = 2, timeout_s: float = 10, job: JobIdentity = JOB,
         secret: bytes = SECRET) -> RoundCoordinator:
    return embedded_coordinator("127.0.0.1", port, job, secret, rank, nodes, timeout_s)


def join_all(coords: list[RoundCoordinator], mins: list[int] | None = None) -> list[int]:
    """Every node joins at once (a fresh store waits for all proposals)."""
    out: dict[int, int] = {}
    threads = [threading.Thread(target=lambda i=i, c=c: out.__setitem__(i, c.join((mins or [0] * len(coords))[i])))
               for i, c in enumerate(coords)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return [out[i] for i in range(len(coords))]


def inv(steps: dict, node: int = 0) -> NodeInventory:
    """An inventory: step -> {"world_size": W, "local": {rank: owner}, "replicas": {rank: owner}} (ranks as
    strings, for the eye; compute_plan numbers the nodes by their place in the list)."""
    def parts(d: dict) -> dict[int, int]:
        return {int(r): o for r, o in d.items()}
    return NodeInventory(node, {s: StepHoldings(v["world_size"], parts(v["local"]), parts(v["replicas"]))
                                for s, v in steps.items()})


def test_plan_picks_newest_step_complete_somewhere() -> None:
    # 3 nodes, one rank each. Step 20: node 2's own part is gone but node 0 holds its replica.
    # Step 30: rank 2's part exists nowhere (node 2 died before replicating it).
    invs = [
        inv({10: {"world_size": 3, "local": {"0": 0}, "replicas": {"2": 2}},
             20: {"world_size": 3, "local": {"0": 0}, "replicas": {"2": 2}},
             30: {"world_size": 3, "local": {"0": 0}, "replicas": {}}}),
        inv({10: {"world_size": 3, "local": {"1": 1}, "replicas": {"0": 0}},
             20: {"world_size": 3, "local": {"1": 1}, "replicas": {"0": 0}},
             30: {"world_size": 3, "local": {"1": 1}, "replicas": {"0": 0}}}),
        inv({}),  # replacement node with an empty disk
    ]
    plan = compute_plan(4, invs)
    assert (plan.step, plan.world_size) == (20, 3)
    assert plan.fetch == {2: {2: [0]}}


def test_plan_ignores_parts_local_to_a_non_owner_and_size_disagreement() -> None:
    invs = [inv({5: {"world_size": 2, "local": {"0": 0, "1": 1}, "replicas": {}}}),  # rank 1 owned by node 1
            inv({5: {"world_size": 3, "local": {}, "replicas": {}}})]
    assert compute_plan(0, invs).step is None
    # Node 0 sees rank 1's part in its directory, but node 1 (its owner) lost it and no replica exists.
    invs = [inv({5: {"world_size": 2, "local": {"0": 0, "1": 1}, "replicas": {}}}), inv({})]
    assert compute_plan(0, invs).step is None
    # Shared filesystem: both nodes see both parts in place.
    both = {5: {"world_size": 2, "local": {"0": 0, "1": 1}, "replicas": {}}}
    assert compute_plan(0, [inv(both), inv(both)]).fetch == {}


def test_rounds_end_and_rejoin_through_real_store() -> None:
    port = free_port()
    leader = node(port, 0)
    follower = node(port, 1)
    assert join_all([leader, follower]) == [0, 0]
    results = {}

    def node1() -> None:
        follower.publish_inventory(0, NodeInventory(1))
        results["plan"] = follower.plan(0)
        follower.mark_ready(0)
        follower.wait_all_ready(0)

    t = threading.Thread(target=node1)
    t.start()
    leader.publish_inventory(0, NodeInventory(0))
    leader.publish_plan(compute_plan(0, leader.inventories(0)))
    leader.mark_ready(0)
    leader.wait_all_ready(0)
    t.join(10)
    assert results["plan"].step is None
    assert follower.ended(0) is None
    assert leader.end(0, "node 0: hang") == "node 0: hang"
    assert follower.end(0, "node 1: peer") == "node 0: hang"  # the first reason wins
    assert follower.ended(0) == "node 0: hang"
    assert leader.join() == 1 and follower.join() == 1
    # A replacement for node 1 joining while attempt 1 is planned and running ends it and joins attempt 2.
    leader.publish_plan(compute_plan(1, [NodeInventory(0), NodeInventory(1)]))
    replacement = node(port, 1)
    assert replacement.join() == 2
    assert leader.ended(1) == "node 1 rejoined"
    replacement.abort("node 1: gave up")
    with pytest.raises(CoordinationError, match="aborted"):
        leader.join()


# ------------------------------------------------------------------------ the persistent tier as a holder

def tier(steps: dict) -> dict[int, TierOffer]:
    """A persistent listing: step -> ranks offered (owners: rank r on node r)."""
    return {s: TierOffer(w, frozenset(ranks), {r: r for r in ranks}) for s, (w, ranks) in steps.items()}


def test_plan_restores_from_persistent_tier_when_every_node_was_wiped() -> None:
    plan = compute_plan(1, [inv({}), inv({})], tier({12: (2, [0, 1]), 18: (2, [0, 1])}))
    assert (plan.step, plan.world_size) == (18, 2)
    assert plan.fetch == {0: {0: [PERSISTENT_HOLDER]}, 1: {1: [PERSISTENT_HOLDER]}}
    # Without owners in the manifests, ranks go to nodes the way torchrun assigns them (2 per node).
    plan = compute_plan(1, [inv({}), inv({})], {18: TierOffer(4, frozenset({0, 1, 2, 3}))})
    assert plan.fetch == {0: {0: [-1], 1: [-1]}, 1: {2: [-1], 3: [-1]}}


def test_plan_prefers_in_place_then_peer_then_persistent_per_part() -> None:
    invs = [inv({18: {"world_size": 2, "local": {"0": 0}, "replicas": {"1": 1}}}),
            inv({})]  # node 1 lost its disk; node 0 holds its replica
    plan = compute_plan(2, invs, tier({18: (2, [0, 1])}))
    assert plan.step == 18 and plan.fetch == {1: {1: [0, PERSISTENT_HOLDER]}}  # rank 0 in place
    # A step newer than anything in place is taken when the tier completes it, part by part.
    invs = [inv({12: {"world_size": 2, "local": {"0": 0}, "replicas": {}},
                 18: {"world_size": 2, "local": {"0": 0}, "replicas": {}}}),
            inv({12: {"world_size": 2, "local": {"1": 1}, "replicas": {}}})]
    assert compute_plan(2, invs).step == 12
    plan = compute_plan(2, invs, tier({18: (2, [1])}))
    assert plan.step == 18 and plan.fetch == {1: {1: [PERSISTENT_HOLDER]}}


def test_plan_excludes_bad_parts_and_falls_back() -> None:
    invs = [inv({}), inv({})]
    listing = tier({6: (2, [0, 1]), 12: (2, [0, 1]), 18: (2, [0, 1])})
    assert compute_plan(3, invs, listing, exclude={(18, 1, PERSISTENT_HOLDER)}).step == 12
    bad = {(18, 1, PERSISTENT_HOLDER), (12, 0, PERSISTENT_HOLDER), (6, 0, PERSISTENT_HOLDER)}
    assert compute_plan(3, invs, listing, exclude=bad).step is None  # fresh start, never a loop
    # A peer holder that failed is skipped, the tier still serves the part.
    invs = [inv({18: {"world_size": 2, "local": {"0": 0}, "replicas": {"1": 1}}}), inv({})]
    plan = compute_plan(3, invs, listing, exclude={(18, 1, 0)})
    assert plan.fetch == {1: {1: [PERSISTENT_HOLDER]}}
    # The tier and the nodes disagree about the world size: the step is not usable.
    invs = [inv({18: {"world_size": 2, "local": {"0": 0}, "replicas": {}}}), inv({})]
    assert compute_plan(3, invs, tier({18: (3, [1])})).step is None


def test_plan_tries_and_fetch_results_through_real_store() -> None:
    port = free_port()
    leader = node(port, 0)
    follower = node(port, 1)
    listing = tier({12: (2, [0, 1]), 18: (2, [0, 1])})
    leader.publish_plan(compute_plan(0, [inv({}), inv({})], listing))
    assert follower.plan(0).step == 18
    follower.publish_fetch_result(0, 0, FetchResult(bad=[(18, 1)]))
    leader.publish_fetch_result(0, 0, FetchResult())
    results = leader.fetch_results(0, 0)
    assert [r.bad for r in results] == [[], [(18, 1)]] and not any(r.error for r in results)
    bad = {(s, r, PERSISTENT_HOLDER) for res in results for s, r in res.bad}
    leader.publish_plan(compute_plan(0, [inv({}), inv({})], listing, exclude=bad), 1)
    assert follower.plan(0, 1).step == 12 and follower.plan(0).step == 18  # each try keeps its own key


def test_a_wait_inside_a_round_ends_when_a_replacement_rejoins() -> None:
    """Node 1 died mid-fetch: node 0 waits for its fetch result. The replacement's rejoin ends the round,
    and node 0's wait stops at once (RoundEnded) instead of running out the rendezvous timeout."""
    from supervisor.cluster.round_errors import RoundEnded

    port = free_port()
    leader = node(port, 0, timeout_s=60)
    dead = node(port, 1, timeout_s=60)
    assert join_all([leader, dead]) == [0, 0]
    dead.publish_inventory(0, NodeInventory(1))
    leader.publish_inventory(0, NodeInventory(0))
    leader.publish_plan(compute_plan(0, leader.inventories(0)))
    leader.publish_fetch_result(0, 0, FetchResult())
    caught: list[BaseException] = []

    def node0() -> None:
        try:
            leader.fetch_results(0, 0)
        except BaseException as e:  # handed to the test thread
            caught.append(e)

    t = threading.Thread(target=node0)
    t.start()
    assert node(port, 1, timeout_s=60).join() == 1  # the replacement
    t.join(10)
    assert not t.is_alive(), "node 0 kept waiting for the dead node's fetch result"
    assert caught and isinstance(caught[0], RoundEnded) and "node 1 rejoined" in str(caught[0])
    assert leader.join() == 1


# ------------------------------------------------------------------------ job identity and a lost node 0


def test_a_node_of_another_job_is_refused_naming_both_jobs() -> None:
    """Two jobs on the same hosts with the default port: the second one's nodes never join the first's store."""
    from supervisor.cluster.round_errors import JobClash

    port = free_port()
    leader = node(port, 0)
    other = JobIdentity("job-b", "checkpoint_dir 'b'")
    with pytest.raises(JobClash, match="job-a.*this node is job job-b"):
        node(port, 1, job=other)
    with pytest.raises(JobClash, match="coordinator port .* taken by rlsup job 'job-a'"):
        node(port, 0, job=other)  # its node 0 cannot host, and names who does
    with pytest.raises(JobClash):  # the same job name with another secret is another job too
        node(port, 1, secret=b"another-secret-of-16+")
    assert leader.join is not None


def test_forged_values_are_ignored_and_named(caplog: pytest.LogCaptureFixture) -> None:
    """A writer without the job's secret (another job, a stale or hostile client) cannot end an attempt or
    plant a plan: the embedded store refuses its connection, and values that reach a store unsigned (etcd, which
    any client of its cluster can write) do not verify and are ignored, with the key named in the log."""
    from supervisor.cluster.kvstore import EmbeddedKVStore, StoreRefused

    port = free_port()
    leader, follower = node(port, 0), node(port, 1)
    assert join_all([leader, follower]) == [0, 0]
    with pytest.raises(StoreRefused):
        EmbeddedKVStore("127.0.0.1", port, b"not-the-job-secret-16", False, 5.0)
    intruder = leader.store  # node 0's own handle writes the table as it is: unsigned values, as in etcd
    intruder.set("rlsup/job-a/end/0", b"node 9: forged")
    intruder.set("rlsup/job-a/plan/0", b'{"round": 0, "step": 999, "world_size": 1, "fetch": {}}')
    assert follower.ended(0) is None
    assert "ignored rlsup/job-a/end/0" in caplog.text  # through the logging channel (supervisor.cluster.coordinator)
    assert leader.end(0, "node 0: real") == "node 0: real"  # the signed writer takes the key back
    assert follower.ended(0) == "node 0: real"


def test_a_reconnect_that_finds_another_jobs_store_on_node_0s_port_is_a_clash() -> None:
    """Node 0 went away and another job (another secret) now hosts its store on the port: the reconnect names it
    (JobClash) instead of waiting out rendezvous_timeout for a store that refuses this node."""
    port = free_port()
    leader, follower = node(port, 0), node(port, 1)
    leader.store.close()
    other = node(port, 0, job=JobIdentity("job-b", "job_name"), secret=b"another-secret-of-16+")
    assert follower.reconnect is not None
    with pytest.raises(JobClash, match="hosted for rlsup job 'job-b' .*refused this job's secret"):
        follower.reconnect(5.0)
    other.store.close()


def test_a_replacement_node_0_hosts_a_fresh_store_and_the_job_keeps_counting() -> None:
    """Node 0's supervisor dies (its embedded store with it). The other node waits in join for a
    replacement node 0, which hosts a new store; they agree on the next attempt from their proposals."""
    port = free_port()
    leader, follower = node(port, 0, timeout_s=30), node(port, 1, timeout_s=30)
    assert join_all([leader, follower]) == [0, 0]
    leader.end(0, "node 0: crashed")
    assert join_all([leader, follower]) == [1, 1]
    leader.store.close()
    del leader  # the store goes with node 0's supervisor
    import gc

    gc.collect()
    got: dict[str, int] = {}
    t = threading.Thread(target=lambda: got.__setitem__("follower", follower.join(2)))
    t.start()
    replacement = node(port, 0, timeout_s=30)  # an empty disk: it would start at attempt 0
    assert replacement.join(0) == 2
    t.join(30)
    assert got == {"follower": 2}


# ------------------------------------------------------------------------ values that do not parse


def test_values_that_do_not_parse_never_crash_a_node(caplog: pytest.LogCaptureFixture) -> None:
    """A node of another version (or a broken one) holding the job's secret publishes values that do not
    parse: an inventory ends the attempt for all (planning without that node's parts could start afresh over
    checkpoints it still holds), its fetch result is a failed fetch, a plan that does not parse ends the
    attempt for all, and a bad attempt number stops the join with a clear error; each is named with its
    node and field."""
    from supervisor.cluster.round_errors import RoundEnded

    port = free_port()
    leader, follower = node(port, 0), node(port, 1)
    assert join_all([leader, follower]) == [0, 0]
    leader.publish_inventory(0, inv({5: {"world_size": 2, "local": {"0": 0}, "replicas": {"1": 1}}}))
    follower.keys.set("inv/0/1", '{"node": 1, "steps": {"5": {"world_size": "2", "local": {}, "replicas": {}}}}')
    with pytest.raises(RoundEnded, match="node 1's inventory: steps.5.world_size"):
        leader.inventories(0)
    assert "node 0: node 1's inventory: steps.5.world_size" in (leader.ended(0) or "")
    assert "another rlsup version" in (follower.ended(0) or "")

    follower.keys.set("fetched/0/0/1", '{"bad": "all"}')
    leader.publish_fetch_result(0, 0, FetchResult())
    assert "node 1's fetch result: bad" in leader.fetch_results(0, 0)[1].error
    assert "node 1: node 1's fetch result: bad" in follower.fetch_results(0, 0)[0].error  # the attempt will end

    leader.keys.set("plan/1", '{"round": 1, "step": 5}')
    with pytest.raises(RoundEnded, match="node 0's plan: step"):
        follower.plan(1)
    assert "node 1: node 0's plan: step" in (leader.ended(1) or "")

    lone = node(free_port(), 0, nodes=1)
    lone.keys.set("base", "-")
    with pytest.raises(CoordinationError, match="node 0 stored base = '-', not an attempt number"):
        lone.join()


def fail_one_poll(coordinator: RoundCoordinator) -> None:
    """The coordinator's next store poll raises as a timed-out store call does (then polls work again)."""
    from supervisor.cluster.kvstore import StoreUnavailable

    real = coordinator.keys.poll

    def once(*args: object, **kwargs: object) -> object:
        coordinator.keys.poll = real  # type: ignore[method-assign]
        raise StoreUnavailable("a store call timed out (the test's)")

    coordinator.keys.poll = once  # type: ignore[method-assign]


def test_a_store_error_in_a_nodes_own_join_does_not_end_the_attempt() -> None:
    """Seen in a fast-tier run on a loaded machine: the follower proposed, its wait for ``base`` failed on a store
    call (a timeout), and the retried join found ``base`` there and took itself for a node that rejoins: it ended
    attempt 0 for everyone and joined attempt 1. Its own join, retried, is the same attempt."""
    port = free_port()
    leader, follower = node(port, 0), node(port, 1)
    fail_one_poll(follower)
    assert join_all([leader, follower], [5, 5]) == [5, 5]
    assert leader.ended(5) is None


def test_a_later_join_still_ends_an_attempt_the_node_abandoned() -> None:
    """Review finding on the fix above: scoped to the first round, it also let a node that gave up attempt 0 without
    ending it (a lost store in its wait for every node's ready) rejoin attempt 0 while the others ran it. A join
    after the one that proposed ends the attempt and takes the next."""
    from supervisor.cluster.round_errors import RoundEnded

    port = free_port()
    leader, follower = node(port, 0), node(port, 1)
    assert join_all([leader, follower]) == [0, 0]

    def follower_round() -> None:
        follower.publish_inventory(0, NodeInventory(1))
        follower.plan(0)
        follower.publish_fetch_result(0, 0, FetchResult())
        follower.fetch_results(0, 0)
        follower.mark_ready(0)
        fail_one_poll(follower)
        with pytest.raises(RoundEnded):
            follower.wait_all_ready(0)

    t = threading.Thread(target=follower_round)
    t.start()
    leader.publish_inventory(0, NodeInventory(0))
    leader.publish_plan(compute_plan(0, leader.inventories(0)))
    leader.publish_fetch_result(0, 0, FetchResult())
    leader.fetch_results(0, 0)
    leader.mark_ready(0)
    leader.wait_all_ready(0)
    t.join(20)
    assert follower.join(1) == 1
    assert "node 1 rejoined" in (leader.ended(0) or "")


def test_a_store_error_while_waiting_for_a_fresh_stores_base_mid_job_is_retried() -> None:
    """Node 0 was replaced mid-job (a fresh store, no first round): a follower's wait for ``base`` that fails on
    one store call reconnects within rendezvous_timeout and joins the attempt, as in the first round."""
    port = free_port()
    leader, follower = node(port, 0, timeout_s=30), node(port, 1, timeout_s=30)
    assert join_all([leader, follower]) == [0, 0]
    follower.end_first_round()  # as wait_all_ready does: attempt 0 ran
    leader.end(0, "node 0: crashed")
    leader.store.close()
    del leader
    import gc

    gc.collect()
    got: dict[str, object] = {}

    def follower_join() -> None:
        try:
            got["follower"] = follower.join(1)
        except CoordinationError as e:
            got["follower"] = e

    fail_one_poll(follower)  # its first poll is the wait for base in the replacement's store
    t = threading.Thread(target=follower_join)
    t.start()
    replacement = node(port, 0, timeout_s=30)
    assert replacement.join(0) == 1
    t.join(30)
    assert got == {"follower": 1}
