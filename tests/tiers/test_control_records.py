"""The records that cross the coordination store: each survives its JSON form, and a value that does not
parse is refused with an error naming the node and the field (never a KeyError deep in the planner)."""

from __future__ import annotations

import json

import pytest

from supervisor.tiers.holdings import (
    PERSISTENT_HOLDER,
    FetchResult,
    InventoryBuilder,
    NodeInventory,
    RecordError,
    RoundPlan,
    StepHoldings,
)


def test_inventory_round_trip_keeps_every_part_with_int_keys() -> None:
    inv = NodeInventory(3, {12: StepHoldings(8, {6: 3, 7: 3}, {4: 2, 5: 2, 0: 0}), 18: StepHoldings(8, {6: 3}, {})})
    text = inv.to_json()
    # On the wire a step's parts are grouped by owner (one list of ranks each), in rank order.
    assert json.loads(text)["steps"]["12"] == {"world_size": 8, "local": {"3": [6, 7]},
                                               "replicas": {"0": [0], "2": [4, 5]}}
    assert NodeInventory.from_json(text, 3) == inv
    assert NodeInventory.from_json(text.encode(), 3) == inv  # a store's bytes as they come
    assert NodeInventory.from_json(NodeInventory(0).to_json(), 0) == NodeInventory(0)


def test_builder_keeps_one_world_size_per_step_and_merges_another_place() -> None:
    disk = InventoryBuilder(1)
    disk.add(5, 4, 2, 1)
    disk.add(5, 8, 3, 1)  # another world size at the same step: part of no plan of that step
    disk.add(5, 4, 0, 0, replica=True)
    memory = InventoryBuilder(1)
    memory.add(5, 4, 3, 1)
    memory.add(6, 4, 2, 1)
    merged = InventoryBuilder(1)
    merged.add_inventory(disk.build())
    merged.add_inventory(memory.build())
    assert merged.build() == NodeInventory(1, {5: StepHoldings(4, {2: 1, 3: 1}, {0: 0}), 6: StepHoldings(4, {2: 1})})


def test_plan_and_fetch_result_round_trip() -> None:
    plan = RoundPlan(4, 20, 3, {2: {2: [0, PERSISTENT_HOLDER]}})
    assert json.loads(plan.to_json())["round"] == 4  # the wire's key, kept stable
    assert RoundPlan.from_json(plan.to_json()) == plan
    fresh = RoundPlan(0, None, None, {})
    assert RoundPlan.from_json(fresh.to_json()) == fresh
    result = FetchResult([(18, 1)], "peer gone")
    assert FetchResult.from_json(result.to_json(), 1) == result
    assert FetchResult.from_json("{}", 1) == FetchResult()


def good_inventory() -> dict:
    return {"node": 2, "steps": {"12": {"world_size": 4, "local": {"2": [2, 3]}, "replicas": {"0": [0]}}}}


def broken(path: list[str], value: object) -> dict:
    """good_inventory() with the value at ``path`` replaced (or removed: ``...``)."""
    data = good_inventory()
    where = data
    for key in path[:-1]:
        where = where[key]
    if value is ...:
        del where[path[-1]]
    else:
        where[path[-1]] = value
    return data


@pytest.mark.parametrize("data, field", [
    (broken(["node"], 5), "node"),  # published under node 2's key
    (broken(["node"], ...), "node"),
    (broken(["node"], True), "node"),
    (broken(["steps"], ...), "steps"),
    (broken(["steps"], [12]), "steps"),
    (broken(["steps", "x1"], {}), "steps.x1"),
    (broken(["steps", "12"], "all"), "steps.12"),
    (broken(["steps", "12", "world_size"], "4"), "steps.12.world_size"),
    (broken(["steps", "12", "world_size"], 0), "steps.12.world_size"),
    (broken(["steps", "12", "world_size"], ...), "steps.12.world_size"),
    (broken(["steps", "12", "local"], ...), "steps.12.local"),
    (broken(["steps", "12", "local"], [2, 3]), "steps.12.local"),
    (broken(["steps", "12", "local", "2"], "2"), "steps.12.local.2"),
    (broken(["steps", "12", "local", "2"], [2, -3]), "steps.12.local.2"),
    (broken(["steps", "12", "local", "2"], [2, True]), "steps.12.local.2"),
    (broken(["steps", "12", "replicas", "-1"], [1]), "steps.12.replicas.-1"),
    (broken(["steps", "12", "replicas", "one"], [1]), "steps.12.replicas.one"),
    (broken(["steps", "12", "replicas", "1"], [0]), "steps.12.replicas"),  # rank 0 under two owners
    (broken(["steps", "12", "local", "2"], [2, 2]), "steps.12.local"),
])
def test_inventory_refused_naming_node_and_field(data: dict, field: str) -> None:
    with pytest.raises(RecordError) as caught:
        NodeInventory.from_json(json.dumps(data), 2)
    assert str(caught.value).startswith(f"node 2's inventory: {field}: ")
    assert (caught.value.node, caught.value.where) == (2, field)


def test_inventory_refused_when_not_json_or_not_an_object() -> None:
    weird = {"steps": {"12": {}}}
    for text, message in [("{", "not JSON"), ("[1, 2]", "not a JSON object"), (json.dumps(weird), "node")]:
        with pytest.raises(RecordError, match=f"node 1's inventory: .*{message}"):
            NodeInventory.from_json(text, 1)


@pytest.mark.parametrize("text, field", [
    ('{"round": -1, "step": null, "world_size": null, "fetch": {}}', "round"),
    ('{"round": 1, "step": 5, "world_size": null, "fetch": {}}', "step"),
    ('{"round": 1, "step": "5", "world_size": 2, "fetch": {}}', "step"),
    ('{"round": 1, "step": 5, "world_size": 2}', "fetch"),
    ('{"round": 1, "step": 5, "world_size": 2, "fetch": {"a": {}}}', "fetch.a"),
    ('{"round": 1, "step": 5, "world_size": 2, "fetch": {"1": {"1": [0, -2]}}}', "fetch.1.1"),
    ('{"round": 1, "step": 5, "world_size": 2, "fetch": {"1": {"1": 0}}}', "fetch.1.1"),
])
def test_plan_refused_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(RecordError, match=f"^node 0's plan: {field}: "):
        RoundPlan.from_json(text, 0)


@pytest.mark.parametrize("text, field", [
    ('{"bad": [[18]]}', "bad"),
    ('{"bad": [["18", 1]]}', "bad"),
    ('{"bad": {}}', "bad"),
    ('{"error": 3}', "error"),
])
def test_fetch_result_refused_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(RecordError, match=f"^node 4's fetch result: {field}: "):
        FetchResult.from_json(text, 4)


def test_oversized_numbers_are_refused_as_records_never_as_crashes() -> None:
    """A key of thousands of digits (int() raises a plain ValueError past Python's digit limit) and a world
    size the planner would build a set of: refused naming node and field, like any other bad value."""
    huge = "9" * 5000
    data = good_inventory()
    data["steps"][huge] = data["steps"]["12"]
    with pytest.raises(RecordError, match="node 2's inventory: steps"):
        NodeInventory.from_json(json.dumps(data), 2)
    owner = good_inventory()
    owner["steps"]["12"]["local"] = {huge: [0]}
    with pytest.raises(RecordError, match="node 2's inventory: steps.12.local"):
        NodeInventory.from_json(json.dumps(owner), 2)
    world = broken(["steps", "12", "world_size"], 10**12)
    with pytest.raises(RecordError, match="node 2's inventory: steps.12.world_size: .* up to"):
        NodeInventory.from_json(json.dumps(world), 2)
    with pytest.raises(RecordError, match="node 0's plan: step"):
        RoundPlan.from_json('{"round": 1, "step": 5, "world_size": 1000000000000, "fetch": {}}', 0)
    with pytest.raises(RecordError, match="node 0's plan: fetch"):
        RoundPlan.from_json('{"round": 1, "step": 5, "world_size": 2, "fetch": {"%s": {}}}' % huge, 0)

