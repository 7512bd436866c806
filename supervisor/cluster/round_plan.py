"""The round's plan: the newest step whose every rank part is valid somewhere, and what each node fetches.

Node 0 computes it from every node's inventory (and the persistent tier's listing) in each round of
:mod:`supervisor.cluster.coordinator`; a pure function of what the nodes hold, so it is tested and benchmarked alone.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from supervisor.tiers.holdings import PERSISTENT_HOLDER, NodeInventory, RoundPlan, StepHoldings, TierOffer


def compute_plan(attempt: int, inventories: Sequence[NodeInventory], persistent: Mapping[int, TierOffer] | None = None,
                 exclude: Iterable[tuple[int, int, int]] = (), newer_than: int | None = None) -> RoundPlan:
    """The newest step whose every rank part is valid somewhere, and what each node must fetch.

    ``inventories``: every node's, in node order. A part is in place when its owner holds it locally (a
    shared filesystem counts), else it must come from a replica holder, else from the persistent tier;
    a part found nowhere makes the step unusable.

    ``persistent`` (the tier's listing, step -> :class:`TierOffer`) adds the tier as the last holder
    (:data:`PERSISTENT_HOLDER`) of the parts it lists: in place > peer > persistent. A part goes to its
    owner as the inventories or the tier's manifests record it, else (a trainer that records no node) to
    the node torchrun runs the rank on. ``exclude`` removes (step, rank, holder) triples that failed, so
    a plan is never made twice with the same bad holder. ``newer_than``: only steps newer than this are
    planned (the steps a plan of the inventories alone did not reach; no plan, :data:`None` step, when none is
    usable).
    """
    excluded = set(exclude)
    # Which inventories list each step; a step's parts are read only when the steps newer than it were
    # not usable, so the common case (the newest step is) reads one step of every inventory, not all.
    listed: dict[int, list[tuple[int, StepHoldings]]] = {}
    for node, inv in enumerate(inventories):
        for step, held in inv.steps.items():
            listed.setdefault(step, []).append((node, held))
    tier = persistent or {}
    for step in sorted(listed.keys() | tier.keys(), reverse=True):
        if newer_than is not None and step <= newer_than:
            break
        fetch = _plan_step(step, listed.get(step, []), tier.get(step), excluded, len(inventories))
        if fetch is not None:
            return RoundPlan(attempt, step, fetch[0], fetch[1])
    return RoundPlan(attempt, None, None, {})


Fetches = dict[int, dict[int, list[int]]]  # node -> rank -> holders, as in RoundPlan.fetch


def _plan_step(step: int, entries: list[tuple[int, StepHoldings]], offer: TierOffer | None,
               excluded: set[tuple[int, int, int]], num_nodes: int) -> tuple[int, Fetches] | None:
    """(world size, node -> rank -> holders) when every part of ``step`` is somewhere, else None."""
    world_sizes = {held.world_size for _, held in entries}
    if offer is not None:
        world_sizes.add(offer.world_size)
    if len(world_sizes) != 1:
        return None  # nodes (or the tier) disagree about the job's size at this step: not usable
    (world,) = world_sizes
    in_place: set[int] = set()
    for node, held in entries:  # map and set operations: this runs for every node
        owners_here = list(held.local.values())
        if owners_here.count(node) == len(owners_here):
            in_place.update(held.local)
        else:
            in_place.update(r for r, o in held.local.items() if o == node)
    missing = sorted(set(range(world)).difference(in_place))
    # A part's owner: the first inventory (in node order, local before replicas) to name it, then the
    # tier's manifests; updating from the last inventory to the first leaves the first one's word.
    owners: dict[int, int] = {}
    for _, held in reversed(entries):
        owners.update(held.replicas)
        owners.update(held.local)
    holders: dict[int, list[int]] = {}  # only for the parts not in place
    wanted = set(missing)
    for node, held in entries:
        for rank in wanted.intersection(held.replicas):
            if not excluded or (step, rank, node) not in excluded:
                holders.setdefault(rank, []).append(node)
    in_tier: set[int] = set()
    if offer is not None:
        in_tier = {r for r in offer.ranks if (step, r, PERSISTENT_HOLDER) not in excluded}
        for rank, owner in offer.owners.items():
            owners.setdefault(rank, owner)
    fetch: Fetches = {}
    for rank in missing:
        found = sorted(holders.get(rank, []))
        if rank in in_tier:
            found.append(PERSISTENT_HOLDER)
        owner = owners.get(rank, _default_owner(rank, world, num_nodes))
        if not found or owner is None:
            return None
        fetch.setdefault(owner, {})[rank] = found
    return world, fetch


def _default_owner(rank: int, world: int, num_nodes: int) -> int | None:
    """The node a rank runs on when nothing records it: torchrun's contiguous blocks of
    ``world / num_nodes`` ranks per node (None when the world does not divide evenly)."""
    if num_nodes <= 0 or world % num_nodes:
        return None
    return rank // (world // num_nodes)


def saved_by(inventories: Mapping[int, NodeInventory], step: int) -> tuple[int, set[int]] | None:
    """(how many nodes saved ``step``, those of them the inventories name): the owners the parts name, or, when some
    owner's parts are in no inventory (a wiped node's, kept only by the persistent tier), the step's world size over
    the most ranks one node owns in it; None when no inventory lists the step."""
    owners: dict[int, set[int]] = {}
    world = None
    for inv in inventories.values():
        held = inv.steps.get(step)
        if held is None:
            continue
        world = held.world_size
        for parts in (held.local, held.replicas):
            for rank, owner in parts.items():
                owners.setdefault(owner, set()).add(rank)
    if world is None or not owners:
        return None
    per_node = max(len(ranks) for ranks in owners.values())
    return max(len(owners), -(-world // per_node)), set(owners)


def same_world(inventories: Mapping[int, NodeInventory], step: int, nodes: Sequence[int]) -> bool:
    """Whether ``step`` was saved by ``nodes`` themselves (as many nodes, and none other): no world change."""
    by = saved_by(inventories, step)
    return by is None or (by[0] == len(nodes) and by[1] <= set(nodes))


def compute_resized_plan(attempt: int, inventories: Mapping[int, NodeInventory],
                         nodes: Sequence[int]) -> RoundPlan | str:
    """The plan for running on ``nodes`` (node ranks of the job, ascending), a world of another size than the one
    that saved the step: the newest step every part of which is held by these nodes, if its parts say it may be
    restored into another world size (:data:`~supervisor.tiers.holdings.Resize`); else why not (a reason for the
    log, and the job is not resized).

    Each node gets the parts the new world's ranks read there (rank 0's, or every part) that it does not hold in
    place: copied from a replica it keeps (itself as the first holder), else fetched from the nodes that keep a
    replica (a part held only in its owner's own directory cannot be served: the step is then not usable, and an
    older one may be). A step saved by exactly ``nodes`` needs nothing fetched: each node holds its own ranks'
    parts."""
    unreachable = ""
    listed: dict[int, list[tuple[int, StepHoldings]]] = {}
    for node in nodes:
        for step, held in inventories[node].steps.items():
            listed.setdefault(step, []).append((node, held))
    for step in sorted(listed, reverse=True):
        entries = listed[step]
        worlds = {held.world_size for _, held in entries}
        if len(worlds) != 1:
            continue
        (world,) = worlds
        where: dict[int, set[tuple[int, bool]]] = {}  # rank -> (node, in place there)
        owners: dict[int, int] = {}
        for node, held in entries:
            for rank, owner in held.local.items():
                where.setdefault(rank, set()).add((node, True))
                owners.setdefault(rank, owner)
            for rank, owner in held.replicas.items():
                where.setdefault(rank, set()).add((node, False))
                owners.setdefault(rank, owner)
        if not set(range(world)).issubset(where):
            continue  # not complete on these nodes: an older step may be
        if same_world(inventories, step, nodes):  # each node's own parts: in place, or fetched as any plan does
            found = _plan_step(step, entries, None, set(), len(nodes))
            if found is None:
                continue
            return RoundPlan(attempt, step, world, found[1], tuple(nodes))
        resizes = {held.resize for _, held in entries}
        if len(resizes) != 1 or "" in resizes:
            return (f"step {step} (the newest complete on nodes {list(nodes)}) was not saved as restorable into "
                    "another world size (trainer_hooks marks a save resizable; a trainer without it, or a layout "
                    "rlsup only reads, is never resized)")
        need = [0] if resizes == {"rank0"} else range(world)
        fetch = _resize_fetch(step, nodes, need, where, owners)
        if isinstance(fetch, str):
            unreachable = unreachable or fetch
            continue
        wanted = {rank for parts in fetch.values() for rank in parts}
        return RoundPlan(attempt, step, world, fetch, tuple(nodes), {r: owners[r] for r in sorted(wanted)},
                         (saved_by(inventories, step) or (len(nodes), set()))[0])
    return unreachable or f"no step is complete on nodes {list(nodes)}"


def _resize_fetch(step: int, nodes: Sequence[int], need: Iterable[int], where: Mapping[int, set[tuple[int, bool]]],
                  owners: Mapping[int, int]) -> Fetches | str:
    """What each of ``nodes`` fetches of the ranks ``need`` (rank -> holders: itself first when it keeps a replica),
    or why a part cannot be had (held only in its owner's own directory, which no peer serves)."""
    fetch: Fetches = {}
    for node in nodes:
        for rank in need:
            if (node, True) in where[rank]:
                continue
            holders = sorted(n for n, here in where[rank] if not here and n != node)
            if (node, False) in where[rank]:
                holders.insert(0, node)
            if not holders:
                return (f"step {step}: rank {rank}'s part is only in node {owners[rank]}'s own directory, which no peer "
                        "serves (raise replication_factor so that every part has a replica)")
            fetch.setdefault(node, {})[rank] = holders
    return fetch
