"""The records the nodes exchange through the coordination store, and their one JSON form each.

What a node holds (:class:`NodeInventory`), what node 0 planned (:class:`RoundPlan`) and how a node's
fetch ended (:class:`FetchResult`) cross the control plane as JSON in a signed store value
(:mod:`supervisor.cluster.coordinator`). The signature proves who wrote a value, not that it parses: a node
of another version, or a broken one holding the job's secret, may write anything. So each record is
read back by one ``from_json`` that checks every field and refuses the rest with a
:class:`RecordError` naming the node and the field; the coordinator decides what a refused value
costs (an inventory that holds nothing, a failed fetch, an ended attempt), never a crashed node.

Everywhere else these are typed records with int keys: step, rank and node numbers are strings only
on the wire (JSON object keys). The wire form is this version's: every node of a job runs the same
rlsup, and a node of another version is refused field by field, as above.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, NoReturn

from rlsup_format.manifest import RankManifest

# The persistent tier as a pseudo-holder in RoundPlan.fetch (node ranks are >= 0).
PERSISTENT_HOLDER = -1

#: What a step saved by W ranks needs on every node to be restored into another world size: nothing is possible
#: (""), rank 0's part (``rank0``: trainer_hooks' torch backend, every new rank loads rank 0's replicated state), or
#: every part (``all``: its dcp backend reshards, a new rank reads slices of any old rank's files).
Resize = Literal["", "rank0", "all"]
_RESIZE_BY_BACKEND: Mapping[str, Resize] = {"torch": "rank0", "dcp": "all"}
RESIZES = ("", "rank0", "all")


def resize_of(manifest: RankManifest) -> Resize:
    """What restoring this part's step into another world size needs (:data:`Resize`): its manifest says whether the
    trainer marked the save resizable (:mod:`trainer_hooks.world`) and which backend wrote it."""
    return _RESIZE_BY_BACKEND.get(manifest.backend, "") if manifest.resizable else ""


class RecordError(ValueError):
    """A value from another node that does not parse as the record it should be."""

    def __init__(self, node: int | None, record: str, where: str, problem: str) -> None:
        who = f"node {node}'s" if node is not None else "a"
        super().__init__(f"{who} {record}: {where}: {problem}" if where else f"{who} {record}: {problem}")
        self.node, self.record, self.where = node, record, where


# ------------------------------------------------------------------------------------------ inventory


@dataclass(frozen=True)
class StepHoldings:
    """One node's valid parts of one step, each as rank -> owner (the node whose ranks wrote the part and
    which needs it back to resume). Built once, then only read."""

    world_size: int
    local: Mapping[int, int] = field(default_factory=dict)  # in this node's checkpoint directory or memory tier
    replicas: Mapping[int, int] = field(default_factory=dict)  # copies this node keeps for their owners
    resize: Resize = ""  # what every part here says a restore into another world size needs ("": not possible)


@dataclass(frozen=True)
class NodeInventory:
    """Which checkpoint parts of the job one node holds, fully verified, by step (``inv/<attempt>/<node>``)."""

    node: int
    steps: Mapping[int, StepHoldings] = field(default_factory=dict)

    def to_json(self) -> str:
        """The wire form: each step's parts grouped by owner, ``{"world_size": W, "local": {owner: [rank,
        ...]}, "replicas": {owner: [rank, ...]}}`` (compact, and parsed without a call per part)."""
        return json.dumps({"node": self.node, "steps": {
            str(step): {"world_size": h.world_size, "local": _by_owner(h.local), "replicas": _by_owner(h.replicas),
                        **({"resize": h.resize} if h.resize else {})}
            for step, h in self.steps.items()}})

    @classmethod
    def from_json(cls, text: str | bytes, node: int) -> "NodeInventory":
        """The inventory ``node`` published; :class:`RecordError` naming the field when it does not parse."""
        fail = _Refuser(node, "inventory")
        data = _loads(text, node, "inventory")
        if not isinstance(data, dict):
            fail("", "not a JSON object")
        claimed = data.get("node")
        if not _is_index(claimed) or claimed != node:
            fail("node", f"{claimed!r}: it was published under node {node}")
        raw_steps = data.get("steps")
        if not isinstance(raw_steps, dict):
            fail("steps", "missing or not an object")
        steps: dict[int, StepHoldings] = {}
        for step_s, info in raw_steps.items():
            held = _holdings(info) if _is_key(step_s) else None
            if held is None:
                _refuse_step(step_s, info, fail)
            steps[int(step_s)] = held
        return cls(node, steps)


class InventoryBuilder:
    """Collects one node's parts into a :class:`NodeInventory`. A step's world size is the first part's;
    a later part of that step with another world size belongs to no plan of that step and is left out."""

    def __init__(self, node: int) -> None:
        self.node = node
        self._steps: dict[int, tuple[int, dict[int, int], dict[int, int]]] = {}  # step -> world, local, replicas
        self._resize: dict[int, Resize] = {}  # step -> what its parts agree a resize needs ("" once two differ)

    def add(self, step: int, world_size: int, rank: int, owner: int, *, replica: bool = False,
            resize: Resize = "") -> None:
        world, local, replicas = self._steps.setdefault(step, (world_size, {}, {}))
        if world == world_size:
            (replicas if replica else local)[rank] = owner
            if self._resize.setdefault(step, resize) != resize:
                self._resize[step] = ""

    def add_inventory(self, other: NodeInventory) -> None:
        """Every part ``other`` lists (another place on this node: its memory tier), as it lists it."""
        for step, held in other.steps.items():
            for rank, owner in held.local.items():
                self.add(step, held.world_size, rank, owner, resize=held.resize)
            for rank, owner in held.replicas.items():
                self.add(step, held.world_size, rank, owner, replica=True, resize=held.resize)

    def build(self) -> NodeInventory:
        return NodeInventory(self.node, {step: StepHoldings(*held, self._resize.get(step, ""))
                                         for step, held in self._steps.items()})


def _by_owner(parts: Mapping[int, int]) -> dict[str, list[int]]:
    """rank -> owner as the wire groups it: owner -> its ranks, in order."""
    out: dict[str, list[int]] = {}
    for rank, owner in sorted(parts.items()):
        out.setdefault(str(owner), []).append(rank)
    return out


def _holdings(info: Any) -> StepHoldings | None:
    """One step of an inventory from the wire, or None when anything in it is off (then
    :func:`_refuse_step` says what). Node 0 reads every step of every node's inventory each attempt:
    the checks run in C loops, one Python pass per owner."""
    if type(info) is not dict:
        return None
    world, local, replicas = info.get("world_size"), _owned(info.get("local")), _owned(info.get("replicas"))
    if type(world) is not int or not 0 < world <= MAX_WORLD_SIZE or local is None or replicas is None:
        return None
    resize = info.get("resize", "")
    if resize not in RESIZES:
        return None
    return StepHoldings(world, local, replicas, resize)


def _owned(raw: Any) -> dict[int, int] | None:
    """rank -> owner from the wire's owner -> [rank, ...]; None when it is not that."""
    if type(raw) is not dict:
        return None
    out: dict[int, int] = {}
    listed = 0
    for owner_s, ranks in raw.items():
        if (type(ranks) is not list or not _is_key(owner_s)
                or not _INT.issuperset(map(type, ranks)) or min(ranks, default=0) < 0):
            return None
        out.update(dict.fromkeys(ranks, int(owner_s)))
        listed += len(ranks)
    return out if len(out) == listed else None


def _refuse_step(step_s: str, info: Any, fail: "_Refuser") -> NoReturn:
    """Why :func:`_holdings` refused step ``step_s``, as a :class:`RecordError`."""
    _index_key(step_s, fail, "steps", "a step")
    where = f"steps.{step_s}"
    if not isinstance(info, dict):
        fail(where, "not an object")
    world = info.get("world_size")
    if not _is_index(world) or not 0 < world <= MAX_WORLD_SIZE:
        fail(f"{where}.world_size", f"{world!r} is not a positive integer up to {MAX_WORLD_SIZE}")
    for kind in ("local", "replicas"):
        raw = info.get(kind)
        if not isinstance(raw, dict):
            fail(f"{where}.{kind}", "missing or not an object")
        for owner_s, ranks in raw.items():
            _index_key(owner_s, fail, f"{where}.{kind}", "an owner node")
            if not (isinstance(ranks, list) and all(_is_index(r) for r in ranks)):
                fail(f"{where}.{kind}.{owner_s}", f"{ranks!r} is not a list of ranks (non-negative integers)")
        if _owned(raw) is None:
            fail(f"{where}.{kind}", "a rank is listed twice")
    if info.get("resize", "") not in RESIZES:
        fail(f"{where}.resize", f"{str(info.get('resize'))[:40]!r} is not one of {RESIZES[1:]}")
    fail(where, "does not parse")  # not reached while _holdings and this agree


@dataclass(frozen=True)
class TierOffer:
    """The persistent tier's parts of one step, as node 0 offers them to the plan beside the inventories
    (read from the tier on node 0, never sent): ``owners`` as the manifests record them (a part written
    without a node is left out there, and goes to the node torchrun runs its rank on)."""

    world_size: int
    ranks: frozenset[int]
    owners: Mapping[int, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class RoundPlan:
    """What every node does before attempt ``attempt`` starts (``plan/<attempt>[/<try>]``).

    ``fetch``: node -> rank -> holders to fetch that part from, in order: peer nodes holding a valid
    replica, then :data:`PERSISTENT_HOLDER` when the persistent tier has it. ``world_size``: the step's, in ranks.

    A smaller world (the job goes on without lost nodes): ``nodes`` lists the nodes (by their node rank in the
    job) that run this attempt, in order; the i-th runs it as node i of ``len(nodes)``. A holder in ``fetch`` may
    then be the fetching node itself (a replica it keeps is copied beside its own parts), and ``owners`` names the
    node whose ranks wrote each part fetched (its replicas are kept under that owner)."""

    attempt: int
    step: int | None
    world_size: int | None
    fetch: Mapping[int, Mapping[int, list[int]]]
    nodes: tuple[int, ...] | None = None  # None: every node of the job, each as its own node rank
    owners: Mapping[int, int] = field(default_factory=dict)  # rank -> owner, for the parts of a smaller world
    from_nodes: int | None = None  # how many nodes saved the step, when not ``len(nodes)`` (the world changes)
    lead: int = 0  # the node that planned it, and gathers the round's fetch results and ready marks (0 but after node 0's loss)

    @property
    def changes_world(self) -> bool:
        """Whether the nodes that run this attempt are not as many as those that saved its step."""
        return self.nodes is not None and self.from_nodes is not None and self.from_nodes != len(self.nodes)

    def runs(self, node: int) -> bool:
        """Whether node ``node`` runs this attempt."""
        return self.nodes is None or node in self.nodes

    def to_json(self) -> str:
        # "round": the wire's name for the attempt since the first multi-node release (kept stable).
        out: dict[str, Any] = {"round": self.attempt, "step": self.step, "world_size": self.world_size,
                               "fetch": {str(n): {str(r): s for r, s in parts.items()}
                                         for n, parts in self.fetch.items()}}
        if self.nodes is not None:
            out["nodes"] = list(self.nodes)
            out["owners"] = {str(r): o for r, o in self.owners.items()}
            out["from_nodes"] = self.from_nodes
        if self.lead:
            out["lead"] = self.lead
        return json.dumps(out)

    @classmethod
    def from_json(cls, text: str, node: int = 0) -> "RoundPlan":
        """The plan ``node`` (the planner, node 0) published; :class:`RecordError` when it does not parse."""
        fail = _Refuser(node, "plan")
        d = _loads(text, node, "plan")
        if not isinstance(d, dict):
            fail("", "not a JSON object")
        attempt, step, world = d.get("round"), d.get("step"), d.get("world_size")
        if not _is_index(attempt):
            fail("round", f"{attempt!r} is not an attempt number")
        if (step is None) != (world is None) or not (step is None or (_is_index(step) and _is_index(world)
                                                                      and 0 < world <= MAX_WORLD_SIZE)):
            fail("step", f"step {step!r} with world_size {world!r}: both integers (world size 1 to "
                         f"{MAX_WORLD_SIZE}), or both null")
        raw_fetch = d.get("fetch")
        if not isinstance(raw_fetch, dict):
            fail("fetch", "missing or not an object")
        fetch: dict[int, dict[int, list[int]]] = {}
        for node_s, parts in raw_fetch.items():
            to = _index_key(node_s, fail, "fetch", "a node")
            if not isinstance(parts, dict):
                fail(f"fetch.{node_s}", "not an object")
            for rank_s, holders in parts.items():
                rank = _index_key(rank_s, fail, f"fetch.{node_s}", "a rank")
                if not (isinstance(holders, list) and all(_is_holder(h) for h in holders)):
                    fail(f"fetch.{node_s}.{rank_s}", f"{holders!r} is not a list of holders")
                fetch.setdefault(to, {})[rank] = holders
        nodes, owners = d.get("nodes"), d.get("owners", {})
        if nodes is not None and not (isinstance(nodes, list) and nodes and all(_is_index(n) for n in nodes)
                                      and nodes == sorted(set(nodes))):
            fail("nodes", f"{str(nodes)[:80]} is not a non-empty ascending list of node ranks")
        if not isinstance(owners, dict):
            fail("owners", "not an object")
        owned = {_index_key(r, fail, "owners", "a rank"): o for r, o in owners.items()}
        if not all(_is_index(o) for o in owned.values()):
            fail("owners", f"{str(owners)[:80]} does not map ranks to node ranks")
        from_nodes = d.get("from_nodes")
        if from_nodes is not None and not (_is_index(from_nodes) and from_nodes > 0):
            fail("from_nodes", f"{str(from_nodes)[:40]} is not a node count")
        lead = d.get("lead", 0)
        if not _is_index(lead) or (nodes is not None and lead not in nodes):
            fail("lead", f"{str(lead)[:40]} is not a node rank of the nodes that run the attempt")
        return cls(attempt, step, world, fetch, None if nodes is None else tuple(nodes), owned, from_nodes, lead)


@dataclass
class FetchResult:
    """What one node's fetch for one plan try ended with (``fetched/<attempt>/<try>/<node>``)."""

    bad: list[tuple[int, int]] = field(default_factory=list)  # (step, rank) persistent parts that failed verification
    error: str = ""  # any other failure: the attempt ends, as when a peer fetch fails

    def to_json(self) -> str:
        return json.dumps({"bad": [list(b) for b in self.bad], "error": self.error})

    @classmethod
    def from_json(cls, text: str, node: int | None = None) -> "FetchResult":
        """``node``'s result (node 0 for the union of them all); :class:`RecordError` when it does not parse."""
        fail = _Refuser(node, "fetch result")
        d = _loads(text, node, "fetch result")
        if not isinstance(d, dict):
            fail("", "not a JSON object")
        bad, error = d.get("bad", []), d.get("error", "")
        if not isinstance(bad, list) or not all(
                isinstance(b, list) and len(b) == 2 and _is_index(b[0]) and _is_index(b[1]) for b in bad):
            fail("bad", f"{bad!r} is not a list of [step, rank] pairs")
        if not isinstance(error, str):
            fail("error", f"{error!r} is not a string")
        return cls([(s, r) for s, r in bad], error)


# ------------------------------------------------------------------------------------------ parsing


class _Refuser:
    """Raises the :class:`RecordError` of one record from one node."""

    def __init__(self, node: int | None, record: str) -> None:
        self.node, self.record = node, record

    def __call__(self, where: str, problem: str) -> NoReturn:
        raise RecordError(self.node, self.record, where, problem)


def _loads(text: str | bytes, node: int | None, record: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError of bytes
        raise RecordError(node, record, "", f"not JSON ({e})") from e


_INT = {int}  # the type of a JSON integer as parsed (bool, a subclass, is not one here)
MAX_KEY_DIGITS = 18  # step, rank and node numbers as object keys
MAX_WORLD_SIZE = 1 << 20  # ranks of one step: the planner builds sets of this size


def _is_index(value: Any) -> bool:
    """A step, rank, node or attempt number: a non-negative JSON integer (``true`` is not 1 here)."""
    return type(value) is int and value >= 0


def _is_holder(value: Any) -> bool:
    return type(value) is int and value >= PERSISTENT_HOLDER


def _is_key(key: Any) -> bool:
    """A step, rank or node number as a JSON object key: ASCII decimal digits, at most MAX_KEY_DIGITS of
    them (int() of thousands of digits raises ValueError, and no step or rank is that large)."""
    return isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= MAX_KEY_DIGITS


def _index_key(key: str, fail: _Refuser, where: str, what: str) -> int:
    if not _is_key(key):
        fail(f"{where}.{str(key)[:40]}", f"{str(key)[:40]!r} is not {what} (a non-negative integer of at most "
                                          f"{MAX_KEY_DIGITS} digits)")
    return int(key)
