"""Round coordination through a real TCPStore, and the resume plan across nodes' inventories."""

from __future__ import annotations

import socket
import threading

import pytest

from supervisor.coordinator import CoordinationError, RoundCoordinator, compute_plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inv(steps: dict) -> dict:
    return {"steps": {str(k): v for k, v in steps.items()}}


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
    leader = RoundCoordinator("127.0.0.1", port, 0, 2, timeout_s=10)
    follower = RoundCoordinator("127.0.0.1", port, 1, 2, timeout_s=10)
    assert leader.join() == 0 and follower.join() == 0
    results = {}

    def node1() -> None:
        follower.publish_inventory(0, {"steps": {}})
        results["plan"] = follower.plan(0)
        follower.mark_ready(0)
        follower.wait_all_ready(0)

    t = threading.Thread(target=node1)
    t.start()
    leader.publish_inventory(0, {"steps": {}})
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
    # A replacement for node 1 joining while round 1 is planned and running ends it and joins round 2.
    leader.publish_plan(compute_plan(1, [{"steps": {}}, {"steps": {}}]))
    replacement = RoundCoordinator("127.0.0.1", port, 1, 2, timeout_s=10)
    assert replacement.join() == 2
    assert leader.ended(1) == "node 1 rejoined"
    replacement.abort("node 1: gave up")
    with pytest.raises(CoordinationError, match="aborted"):
        leader.join()


def test_missing_node_times_out_naming_it() -> None:
    leader = RoundCoordinator("127.0.0.1", free_port(), 0, 2, timeout_s=0.5)
    leader.publish_inventory(0, {"steps": {}})
    with pytest.raises(CoordinationError, match="inv/0/1"):
        leader.inventories(0)
