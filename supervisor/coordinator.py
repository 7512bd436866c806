"""Agreement between the node supervisors of one job, through torch.distributed's TCPStore.

Node 0's supervisor hosts the store (as torchrun's c10d rendezvous would); no home-made consensus.
Every attempt is a *round* ``r`` (= ``RLSUP_RESTART_COUNT`` on every node):

1. each node publishes its inventory ``inv/r/<node>`` (which checkpoint parts it holds, locally or as
   replicas for others);
2. node 0 waits for all inventories, computes the plan (the newest step whose every rank part is valid
   somewhere, and where each node fetches what it lacks) and publishes ``plan/r`` and ``round`` = r;
3. each node fetches, then marks ``ready/r/<node>``; all launch once every node is ready;
4. the first node whose attempt fails writes ``end/r`` (compare-and-set: the first reason wins); every
   other node sees it, stops its attempt, and all go to round r+1 together.

A node that joins while round ``c`` is planned and not ended is a replacement for a lost node: it ends
round ``c`` (its predecessor's ranks are gone anyway) and joins ``c+1``. ``abort`` makes every node give up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore


class CoordinationError(RuntimeError):
    """The nodes could not agree in time (a node missing, the store unreachable)."""


@dataclass
class RoundPlan:
    """What every node does before round ``round`` starts."""

    round: int
    step: int | None
    world_size: int | None
    fetch: dict[int, dict[int, list[int]]]  # node -> rank -> nodes holding a valid replica of that part

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
        self._wait(keys, f"inventories of round {rnd}")
        return [json.loads(self._get(k)) for k in keys]

    def publish_plan(self, plan: RoundPlan) -> None:
        self.store.set(f"plan/{plan.round}", plan.to_json())
        self.store.set("round", str(plan.round))

    def plan(self, rnd: int) -> RoundPlan:
        self._wait([f"plan/{rnd}"], f"the plan of round {rnd}")
        return RoundPlan.from_json(self._get(f"plan/{rnd}"))

    def mark_ready(self, rnd: int) -> None:
        self.store.set(f"ready/{rnd}/{self.node_rank}", "1")

    def wait_all_ready(self, rnd: int) -> None:
        self._wait([f"ready/{rnd}/{n}" for n in range(self.num_nodes)], f"all nodes ready for round {rnd}")

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

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self.store.wait(keys, self.timeout)
        except Exception as e:
            missing = [k for k in keys if not self.store.check([k])]
            raise CoordinationError(f"timed out after {self.timeout.total_seconds():.0f}s waiting for {what}; "
                                    f"missing {missing}") from e


def compute_plan(rnd: int, inventories: list[dict[str, Any]]) -> RoundPlan:
    """The newest step whose every rank part is valid on some node, and what each node must fetch.

    An inventory is ``{"steps": {step: {"world_size": W, "local": {rank: owner}, "replicas": {rank: owner}}}}``:
    ``local`` lists the parts valid in that node's own checkpoint directory, ``replicas`` those it holds
    for other nodes; ``owner`` is the node whose ranks wrote the part and which needs it back to resume.
    A part is in place when its owner holds it locally (a shared filesystem counts), else it must come
    from a replica holder; a part neither in place nor replicated makes the step unusable.
    """
    steps: dict[int, dict[str, Any]] = {}
    for node, inv in enumerate(inventories):
        for step_s, info in inv.get("steps", {}).items():
            entry = steps.setdefault(int(step_s), {"world_size": set(), "in_place": set(), "holders": {}})
            entry["world_size"].add(int(info["world_size"]))
            for rank_s, owner in info.get("local", {}).items():
                if int(owner) == node:
                    entry["in_place"].add(int(rank_s))
            for rank_s, owner in info.get("replicas", {}).items():
                entry["holders"].setdefault(int(rank_s), (int(owner), []))[1].append(node)
    for step in sorted(steps, reverse=True):
        entry = steps[step]
        if len(entry["world_size"]) != 1:
            continue  # nodes disagree about the job's size at this step: not a usable checkpoint
        (world,) = entry["world_size"]
        fetch: dict[int, dict[int, list[int]]] = {}
        for rank in range(world):
            if rank in entry["in_place"]:
                continue
            if rank not in entry["holders"]:
                break
            owner, holders = entry["holders"][rank]
            fetch.setdefault(owner, {})[rank] = sorted(holders)
        else:
            return RoundPlan(rnd, step, world, fetch)
    return RoundPlan(rnd, None, None, {})
