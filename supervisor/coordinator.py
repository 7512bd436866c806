"""Agreement between the node supervisors of one job, through torch.distributed's TCPStore.

Node 0's supervisor hosts the store (as torchrun's c10d rendezvous would); no home-made consensus.
Every attempt is a *round* ``r`` (= ``RLSUP_RESTART_COUNT`` on every node):

1. each node publishes its inventory ``inv/r/<node>`` (which checkpoint parts it holds, locally or as
   replicas for others);
2. node 0 waits for all inventories, computes the plan (the newest step whose every rank part is valid
   somewhere: in place, on a peer, or in the persistent tier; and where each node fetches what it lacks)
   and publishes ``plan/r`` and ``round`` = r;
3. each node fetches and publishes ``fetched/r/t/<node>``: the persistent parts that failed verification
   (and any other error). If a part was bad and nothing else failed, node 0 plans again without it
   (``plan/r/t``, t = 1, 2, ...), so the round falls back to an older step instead of ending; a bad
   persistent part is never offered again while node 0's supervisor lives. Then each node marks
   ``ready/r/<node>``; all launch once every node is ready;
4. the first node whose attempt fails writes ``end/r`` (compare-and-set: the first reason wins); every
   other node sees it, stops its attempt, and all go to round r+1 together.

A node that joins while round ``c`` is planned and not ended is a replacement for a lost node: it ends
round ``c`` (its predecessor's ranks are gone anyway) and joins ``c+1``. ``abort`` makes every node give up.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterable

from torch.distributed import TCPStore

WAIT_POLL_S = 0.05  # how often a wait looks at the store (its keys, and the round's end)


# The persistent tier as a pseudo-holder in RoundPlan.fetch (node ranks are >= 0).
PERSISTENT_HOLDER = -1


class CoordinationError(RuntimeError):
    """The nodes could not agree in time (a node missing, the store unreachable)."""


class RoundEnded(CoordinationError):
    """The round ended (a node failed, or a replacement node rejoined) while this node waited inside it."""


@dataclass
class FetchResult:
    """What one node's fetch for one plan try ended with (published so every node sees every result)."""

    bad: list[tuple[int, int]] = field(default_factory=list)  # (step, rank) persistent parts that failed verification
    error: str = ""  # any other failure: the round ends, as when a peer fetch fails

    def to_json(self) -> str:
        return json.dumps({"bad": [list(b) for b in self.bad], "error": self.error})

    @classmethod
    def from_json(cls, text: str) -> "FetchResult":
        d = json.loads(text)
        return cls([(int(s), int(r)) for s, r in d.get("bad", [])], str(d.get("error", "")))


@dataclass
class RoundPlan:
    """What every node does before round ``round`` starts."""

    round: int
    step: int | None
    world_size: int | None
    # node -> rank -> holders to fetch that part from, in order: peer nodes holding a valid replica,
    # then PERSISTENT_HOLDER when the persistent tier has it
    fetch: dict[int, dict[int, list[int]]]

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "step": self.step, "world_size": self.world_size,
                           "fetch": {str(n): {str(r): s for r, s in parts.items()} for n, parts in self.fetch.items()}})

    @classmethod
    def from_json(cls, text: str) -> "RoundPlan":
        d = json.loads(text)
        fetch = {int(n): {int(r): list(s) for r, s in parts.items()} for n, parts in d["fetch"].items()}
        return cls(d["round"], d["step"], d["world_size"], fetch)


class RoundCoordinator:
    """One node's handle on the job's store."""

    def __init__(self, host: str, port: int, node_rank: int, num_nodes: int, timeout_s: float) -> None:
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.timeout = timedelta(seconds=timeout_s)
        try:
            self.store = TCPStore(host, port, None, node_rank == 0, self.timeout, wait_for_workers=False)
        except Exception as e:  # torch raises several types; all mean the same to us
            raise CoordinationError(f"cannot reach the coordination store at {host}:{port}: {e}") from e

    # ------------------------------------------------------------ rounds

    def join(self) -> int:
        """The round this node takes part in next (see the module docstring)."""
        try:
            return self._join()
        except CoordinationError:
            raise
        except Exception as e:  # torch raises DistNetworkError and friends when node 0's store is gone
            raise CoordinationError(f"the coordination store is unreachable: {e}") from e

    def _join(self) -> int:
        if self.store.check(["abort"]):
            raise CoordinationError(f"the job was aborted: {self._get('abort')}")
        if not self.store.check(["round"]):
            return 0
        current = int(self._get("round"))
        if not self.store.check([f"end/{current}"]):
            self.end(current, f"node {self.node_rank} rejoined")
        return current + 1

    def publish_inventory(self, rnd: int, inventory: dict[str, Any]) -> None:
        self.store.set(f"inv/{rnd}/{self.node_rank}", json.dumps(inventory))

    def inventories(self, rnd: int) -> list[dict[str, Any]]:
        keys = [f"inv/{rnd}/{n}" for n in range(self.num_nodes)]
        self._wait(keys, f"inventories of round {rnd}", rnd)
        return [json.loads(self._get(k)) for k in keys]

    @staticmethod
    def _plan_key(rnd: int, attempt_try: int) -> str:
        return f"plan/{rnd}" if attempt_try == 0 else f"plan/{rnd}/{attempt_try}"

    def publish_plan(self, plan: RoundPlan, attempt_try: int = 0) -> None:
        """Try 0 is the round's plan (``round`` = r marks it planned); later tries replace a plan whose
        persistent parts failed verification."""
        self.store.set(self._plan_key(plan.round, attempt_try), plan.to_json())
        if attempt_try == 0:
            self.store.set("round", str(plan.round))

    def plan(self, rnd: int, attempt_try: int = 0) -> RoundPlan:
        key = self._plan_key(rnd, attempt_try)
        self._wait([key], f"the plan of round {rnd}" + (f" (try {attempt_try})" if attempt_try else ""), rnd)
        return RoundPlan.from_json(self._get(key))

    def publish_fetch_result(self, rnd: int, attempt_try: int, result: FetchResult) -> None:
        self.store.set(f"fetched/{rnd}/{attempt_try}/{self.node_rank}", result.to_json())

    def fetch_results(self, rnd: int, attempt_try: int) -> list[FetchResult]:
        """Every node's result of try ``attempt_try`` (waits for all: the same answer on every node)."""
        keys = [f"fetched/{rnd}/{attempt_try}/{n}" for n in range(self.num_nodes)]
        self._wait(keys, f"every node's fetch in round {rnd}", rnd)
        return [FetchResult.from_json(self._get(k)) for k in keys]

    def mark_ready(self, rnd: int) -> None:
        self.store.set(f"ready/{rnd}/{self.node_rank}", "1")

    def wait_all_ready(self, rnd: int) -> None:
        self._wait([f"ready/{rnd}/{n}" for n in range(self.num_nodes)], f"all nodes ready for round {rnd}", rnd)

    def end(self, rnd: int, reason: str) -> str:
        """End round ``rnd`` for everyone; returns the reason that won (maybe another node's)."""
        return self.store.compare_set(f"end/{rnd}", "", reason).decode()

    def ended(self, rnd: int) -> str | None:
        """Non-blocking: why round ``rnd`` ended, or None while it runs."""
        if self.store.check([f"end/{rnd}"]):
            return self._get(f"end/{rnd}")
        return None

    def abort(self, reason: str) -> None:
        self.store.compare_set("abort", "", reason)

    # ------------------------------------------------------------ store access

    def _get(self, key: str) -> str:
        return self.store.get(key).decode()

    def _wait(self, keys: list[str], what: str, rnd: int | None = None) -> None:
        """Poll until every key exists. Inside round ``rnd``, its end (``end/rnd``) stops the wait with
        :class:`RoundEnded`: a node that died there never writes its keys, and its replacement ends the
        round on rejoin, so waiting out the timeout would only lose the job."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            try:
                if self.store.check(keys):
                    return
                if rnd is not None and self.store.check([f"end/{rnd}"]):
                    raise RoundEnded(f"round {rnd} ended while waiting for {what}: {self._get(f'end/{rnd}')}")
                if time.monotonic() > deadline:
                    missing = [k for k in keys if not self.store.check([k])]
                    raise CoordinationError(f"timed out after {self.timeout.total_seconds():.0f}s waiting for "
                                            f"{what}; missing {missing}")
            except CoordinationError:
                raise
            except Exception as e:  # torch raises DistNetworkError and friends when node 0's store is gone
                raise CoordinationError(f"the coordination store is unreachable while waiting for {what}: {e}") from e
            time.sleep(WAIT_POLL_S)


def compute_plan(rnd: int, inventories: list[dict[str, Any]], persistent: dict[int, dict[str, Any]] | None = None,
                 exclude: Iterable[tuple[int, int, int]] = ()) -> RoundPlan:
    """The newest step whose every rank part is valid somewhere, and what each node must fetch.

    An inventory is ``{"steps": {step: {"world_size": W, "local": {rank: owner}, "replicas": {rank: owner}}}}``:
    ``local`` lists the parts valid in that node's own checkpoint directory, ``replicas`` those it holds
    for other nodes; ``owner`` is the node whose ranks wrote the part and which needs it back to resume.
    A part is in place when its owner holds it locally (a shared filesystem counts), else it must come
    from a replica holder, else from the persistent tier; a part found nowhere makes the step unusable.

    ``persistent`` (the tier's listing, ``{step: {"world_size": W, "ranks": [...], "owners": {rank: node}}}``)
    adds the tier as the last holder (:data:`PERSISTENT_HOLDER`) of the parts it lists: in place > peer
    > persistent. A part goes to its owner as the inventories or the tier's manifests record it, else
    (a trainer that records no node) to the node torchrun runs the rank on. ``exclude`` removes
    (step, rank, holder) triples that failed, so a plan is never made twice with the same bad holder.
    """
    excluded = set(exclude)
    steps: dict[int, dict[str, Any]] = {}

    def entry_of(step: int) -> dict[str, Any]:
        return steps.setdefault(step, {"world_size": set(), "in_place": set(), "holders": {}, "owners": {}})

    for node, inv in enumerate(inventories):
        for step_s, info in inv.get("steps", {}).items():
            entry = entry_of(int(step_s))
            entry["world_size"].add(int(info["world_size"]))
            for rank_s, owner in info.get("local", {}).items():
                entry["owners"].setdefault(int(rank_s), int(owner))
                if int(owner) == node:
                    entry["in_place"].add(int(rank_s))
            for rank_s, owner in info.get("replicas", {}).items():
                entry["owners"].setdefault(int(rank_s), int(owner))
                if (int(step_s), int(rank_s), node) not in excluded:
                    entry["holders"].setdefault(int(rank_s), []).append(node)
    for step_s, info in (persistent or {}).items():
        entry = entry_of(int(step_s))
        entry["world_size"].add(int(info["world_size"]))
        entry["persistent"] = {int(r) for r in info.get("ranks", []) if (int(step_s), int(r), PERSISTENT_HOLDER)
                               not in excluded}
        for rank_s, owner in info.get("owners", {}).items():
            entry["owners"].setdefault(int(rank_s), int(owner))
    for step in sorted(steps, reverse=True):
        entry = steps[step]
        if len(entry["world_size"]) != 1:
            continue  # nodes (or the tier) disagree about the job's size at this step: not usable
        (world,) = entry["world_size"]
        fetch: dict[int, dict[int, list[int]]] = {}
        for rank in range(world):
            if rank in entry["in_place"]:
                continue
            holders = sorted(entry["holders"].get(rank, []))
            if rank in entry.get("persistent", ()):
                holders.append(PERSISTENT_HOLDER)
            owner = entry["owners"].get(rank, _default_owner(rank, world, len(inventories)))
            if not holders or owner is None:
                break
            fetch.setdefault(owner, {})[rank] = holders
        else:
            return RoundPlan(rnd, step, world, fetch)
    return RoundPlan(rnd, None, None, {})


def _default_owner(rank: int, world: int, num_nodes: int) -> int | None:
    """The node a rank runs on when nothing records it: torchrun's contiguous blocks of
    ``world / num_nodes`` ranks per node (None when the world does not divide evenly)."""
    if num_nodes <= 0 or world % num_nodes:
        return None
    return rank // (world // num_nodes)
