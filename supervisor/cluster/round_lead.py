"""Who leads: node 0 (:class:`RoundLead`) plans each round from every node's inventory and the persistent tier and
publishes the plan, and at a successful end records the job's end and tells the spares; every other node
(:class:`RoundMember`) reads the plan and has no end-of-run duty. The round itself
(:class:`supervisor.cluster.multinode.NodeGroup`) and the node's run (:class:`supervisor.cluster.node_run.NodeRun`)
are the same on every node: they ask the role, never the rank.
"""

from __future__ import annotations

from typing import Callable, Protocol

from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.round_plan import compute_plan
from supervisor.cluster.spares import DONE_KEY, JobEndWatch
from supervisor.tiers.holdings import PERSISTENT_HOLDER, RoundPlan
from supervisor.tiers.persistent import PersistentTier

Part = tuple[int, int]  # (step, rank)


class RoundRole(Protocol):
    """This node's part in planning a round."""

    def publish_plan(self, attempt: int, plan_try: int, excluded: set[tuple[int, int, int]]) -> None:
        """Plan try ``plan_try`` of ``attempt`` without the (step, rank, holder) triples ``excluded``."""

    def note_bad(self, parts: set[Part]) -> None:
        """Persistent parts that failed verification in a fetch of this round."""

    def finish_job(self, job_end: JobEndWatch | None, last_attempt: int) -> None:
        """The job succeeded in ``last_attempt``: what this node owes the others before the store forgets the job."""


class RoundMember:
    """A node other than 0: node 0 plans; this node fetches what the plan says."""

    def publish_plan(self, attempt: int, plan_try: int, excluded: set[tuple[int, int, int]]) -> None:
        pass

    def note_bad(self, parts: set[Part]) -> None:
        pass

    def finish_job(self, job_end: JobEndWatch | None, last_attempt: int) -> None:
        pass


class RoundLead:
    """Node 0, the planner: each plan computed once, from the inventories and the persistent tier's newer steps;
    persistent parts that failed verification are never offered again in this run."""

    def __init__(self, coordinator: RoundCoordinator, persistent: PersistentTier | None,
                 say: Callable[[str], None]) -> None:
        self.coordinator, self.persistent, self.say = coordinator, persistent, say
        self.bad_persistent: set[Part] = set()

    def publish_plan(self, attempt: int, plan_try: int, excluded: set[tuple[int, int, int]]) -> None:
        self.coordinator.publish_plan(self.plan(attempt, excluded), plan_try)

    def note_bad(self, parts: set[Part]) -> None:
        self.bad_persistent |= parts

    def finish_job(self, job_end: JobEndWatch | None, last_attempt: int) -> None:
        """Record the end where a node cut off until now finds it once the store is gone with this one (a job with
        spares), and set the spares' cue to exit."""
        if job_end is not None:
            job_end.record(0, last_attempt)
        self.coordinator.keys.set(DONE_KEY, "1")

    def plan(self, attempt: int, excluded: set[tuple[int, int, int]]) -> RoundPlan:
        """The newest step every part of which is somewhere: in the nodes' inventories, else (steps newer than
        those) with the persistent tier as the last holder of the parts it lists. Each step is planned once."""
        inventories = self.coordinator.inventories(attempt)
        exclude = excluded | {(s, r, PERSISTENT_HOLDER) for s, r in self.bad_persistent}
        plan = compute_plan(attempt, inventories, exclude=exclude)
        if self.persistent is None:
            return plan
        listing = self._tier_listing(attempt, plan.step)
        if listing:
            newer = compute_plan(attempt, inventories, listing, exclude, newer_than=plan.step)
            plan = newer if newer.step is not None else plan
        self.persistent.protect(plan.step)  # retention keeps the step the nodes are about to fetch
        return plan

    def _tier_listing(self, attempt: int, newer_than: int | None) -> dict | None:
        """The persistent tier's parts of steps newer than ``newer_than``; None or empty when it has none, stalls
        or cannot be listed (the nodes' own parts then decide)."""
        tier, listing = self.persistent, None
        assert tier is not None
        if (stalled := tier.stalled()) is None:
            try:  # a bounded read: a tier that hangs right now must not hold the round (nor a SIGTERM)
                listing = tier.reads.call(lambda: tier.part_listing(newer_than=newer_than, exclude=self.bad_persistent),
                                          None)
            except Exception as e:  # noqa: BLE001 - an unreachable tier must not stop a restart from peers or local parts
                self.say(f"attempt {attempt}: persistent tier {tier.location} not listed: {e}")
                listing = {}
            stalled = tier.stalled() if listing is None else None
        if stalled is not None:
            self.say(f"attempt {attempt}: persistent tier not consulted for the plan: {stalled}")
        return listing


def round_role(node_rank: int, coordinator: RoundCoordinator, persistent: PersistentTier | None,
               say: Callable[[str], None]) -> RoundRole:
    """Node 0 leads every round; the others follow."""
    return RoundLead(coordinator, persistent, say) if node_rank == 0 else RoundMember()


__all__ = ["RoundRole", "RoundLead", "RoundMember", "round_role"]
