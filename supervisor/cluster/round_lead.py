"""Who leads: node 0 (:class:`RoundLead`) plans each round from every node's inventory and the persistent tier and
publishes the plan, and at a successful end records the job's end and tells the spares; every other node
(:class:`RoundMember`) reads the plan and has no end-of-run duty. A job that may go on with fewer nodes, in a store
that outlives node 0 (etcd), goes on without node 0 too (:class:`Succession`: the lead of each attempt is claimed in
the store, and a node other than 0 claims it only when node 0 is missing from the round). The round itself
(:class:`supervisor.cluster.multinode.NodeGroup`) and the node's run (:class:`supervisor.cluster.node_run.NodeRun`)
are the same on every node: they ask the role, never the rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.endpoint_probe import EndpointProbe
from supervisor.cluster.round_errors import RoundEnded
from supervisor.cluster.round_plan import compute_plan, compute_resized_plan, same_world, saved_by
from supervisor.cluster.spares import DONE_KEY, JobEndWatch
from supervisor.tiers.holdings import PERSISTENT_HOLDER, RoundPlan
from supervisor.tiers.persistent import PersistentTier

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig
    from supervisor.tiers.holdings import NodeInventory

Part = tuple[int, int]  # (step, rank)
# a node waiting for node 0 in a round reads what came, and probes node 0's endpoint, once the wait lasted this long
# (a round normally ends sooner: no node reads more, nor dials node 0, in every round)
PROBE_AFTER_S = 1.0


@dataclass(frozen=True)
class ShrinkSettings:
    """When the job goes on with fewer nodes (issue 43): ``min_nodes`` (0: never, the job's node count), after a
    missing node was waited for ``wait_s`` (``spare_takeover_s``: a spare would have taken its rank by then)."""

    min_nodes: int = 0
    wait_s: float = 3.0

    @classmethod
    def from_config(cls, cfg: "SupervisorConfig") -> "ShrinkSettings":
        return cls(cfg.min_nodes, cfg.spare_takeover_s)

    def floor(self, job_nodes: int) -> int | None:
        """The fewest nodes a job of ``job_nodes`` may run on; None: all of them (never fewer)."""
        return self.min_nodes if 0 < self.min_nodes < job_nodes else None


class RoundRole(Protocol):
    """This node's part in planning a round."""

    leads: bool  # plans the round of the attempt it last planned or read (and ends a smaller world's to grow it back)

    def publish_plan(self, attempt: int, plan_try: int, excluded: set[tuple[int, int, int]]) -> None:
        """Plan try ``plan_try`` of ``attempt`` without the (step, rank, holder) triples ``excluded``."""

    def note_bad(self, parts: set[Part]) -> None:
        """Persistent parts that failed verification in a fetch of this round."""

    def launched(self, plan: RoundPlan) -> None:
        """Every node of ``plan`` was ready: its attempt launches."""

    def joined_running(self) -> None:
        """This node joined an attempt the job runs without it (it was lost, and is back): the job has run."""

    def finish_job(self, job_end: JobEndWatch | None, last_attempt: int) -> None:
        """The job succeeded in ``last_attempt``: what this node owes the others before the store forgets the job."""


class RoundMember:
    """A node other than 0: node 0 plans; this node fetches what the plan says."""

    leads = False

    def publish_plan(self, attempt: int, plan_try: int, excluded: set[tuple[int, int, int]]) -> None:
        pass

    def note_bad(self, parts: set[Part]) -> None:
        pass

    def launched(self, plan: RoundPlan) -> None:
        pass

    def joined_running(self) -> None:
        pass

    def finish_job(self, job_end: JobEndWatch | None, last_attempt: int) -> None:
        pass


class RoundLead:
    """Node 0, the planner: each plan computed once, from the inventories and the persistent tier's newer steps;
    persistent parts that failed verification are never offered again in this run."""

    leads = True

    def __init__(self, coordinator: RoundCoordinator, persistent: PersistentTier | None,
                 say: Callable[[str], None], shrink: ShrinkSettings = ShrinkSettings(),
                 spares_left: Callable[[], int] = lambda: 0,
                 endpoints: Callable[[], Sequence[str]] = lambda: (), probe: EndpointProbe | None = None) -> None:
        """``shrink``: when the job may go on with fewer nodes; ``spares_left``: the job's spares not yet used (a
        spare takes a lost node's rank first: the job shrinks only when none is left); ``endpoints``: each node's
        replication endpoint now, by node rank (a spare's, for a rank it took): a missing node whose endpoint refuses
        connects (``probe``, the spare's rule: :mod:`supervisor.cluster.endpoint_probe`) is gone, and the shrink's
        wait ends before ``wait_s``, as a spare's takeover does."""
        self.coordinator, self.persistent, self.say = coordinator, persistent, say
        self.shrink, self.spares_left = shrink, spares_left
        self.endpoints = endpoints
        self.probe = probe or EndpointProbe()
        self.bad_persistent: set[Part] = set()
        self._came: dict[int, dict[int, NodeInventory]] = {}  # attempt -> the inventories its round planned with
        self._told: str = ""  # the last reason given for not going on with fewer nodes (said once)
        self._ran_whole = False  # an attempt of every node launched in this run (or it joined a running job): only then may a node be missed

    def publish_plan(self, attempt: int, plan_try: int, excluded: set[tuple[int, int, int]]) -> None:
        plan, me = self.plan(attempt, excluded), self.coordinator.node_rank
        self.coordinator.publish_plan(replace(plan, lead=me) if me else plan, plan_try)

    def note_bad(self, parts: set[Part]) -> None:
        self.bad_persistent |= parts

    def launched(self, plan: RoundPlan) -> None:
        """An attempt of every node launched: from now on a node missing from a round may be gone for good."""
        if plan.nodes is None or len(plan.nodes) == self.coordinator.num_nodes:
            self._ran_whole = True

    def joined_running(self) -> None:
        """A node back in a running job (not a requeued run's start): a node missing from its next round may be lost."""
        self._ran_whole = True

    def finish_job(self, job_end: JobEndWatch | None, last_attempt: int) -> None:
        """Record the end where a node cut off until now finds it once the store is gone with this one (a job with
        spares), and set the spares' cue to exit."""
        if job_end is not None:
            job_end.record(self.coordinator.node_rank, last_attempt)
        self.coordinator.keys.set(DONE_KEY, "1")

    def floor_now(self) -> int | None:
        """The fewest nodes the job may go on with in this round; None: every node is waited for (no ``min_nodes``
        below the job's size, a spare left to take a lost rank, or no attempt of every node in this run yet: a
        requeued run's nodes starting seconds apart are never taken for lost)."""
        floor = self.shrink.floor(self.coordinator.num_nodes)
        if floor is None or not self._ran_whole or self.coordinator.first_round or self.spares_left() > 0:
            return None
        return floor

    def plan(self, attempt: int, excluded: set[tuple[int, int, int]]) -> RoundPlan:
        """Every node came: :meth:`full_plan`, or, for a step saved by fewer nodes, the plan that grows the job
        back. Fewer came, at least ``min_nodes`` and no spare left: the plan of the smaller world, when the step's
        saves allow it; otherwise every node is waited for, as without ``min_nodes``."""
        job = self.coordinator.num_nodes
        came = self._inventories(attempt)
        if len(came) == job:
            plan = self.full_plan(attempt, [came[n] for n in range(job)], excluded)
            if self.shrink.floor(job) is None or plan.step is None or same_world(came, plan.step, range(job)):
                return plan  # without min_nodes, exactly as before it existed
            grown = compute_resized_plan(attempt, came, list(range(job)))
            if not isinstance(grown, str):
                return grown
            # Not now: the nodes that saved the step go on as they were (the others wait for a later save)
            saved = sorted((saved_by(came, plan.step) or (0, set()))[1] | {self.coordinator.node_rank})
            again = compute_resized_plan(attempt, {n: came[n] for n in saved}, saved)
            self.say(f"attempt {attempt}: cannot grow back to {job} nodes: {grown}")
            return again if not isinstance(again, str) else plan
        smaller = compute_resized_plan(attempt, came, sorted(came))
        if not isinstance(smaller, str):
            return smaller
        missing = sorted(set(range(job)) - set(came))
        why = f"not going on with {len(came)} of {job} nodes (node(s) {missing} missing): {smaller}"
        if why != self._told:
            self._told = why
            self.say(f"attempt {attempt}: {why}; waiting for every node (rendezvous_timeout), as without min_nodes")
        came = self._came[attempt] = dict(enumerate(self.coordinator.inventories(attempt)))
        return self.full_plan(attempt, [came[n] for n in range(job)], excluded)

    def _inventories(self, attempt: int) -> dict[int, NodeInventory]:
        """The inventories this attempt's round plans with (node -> inventory): every node's; or, when the job may
        go on with fewer (``min_nodes``, no spare left, and this run has had an attempt of every node: a requeued
        run's nodes starting seconds apart are never taken for lost), those that came within the shrink's wait once
        enough are there. The same answer for every plan try of the attempt."""
        if (came := self._came.get(attempt)) is not None:
            return came
        floor = self.floor_now()
        if floor is None:
            came = dict(enumerate(self.coordinator.inventories(attempt)))
        else:
            self.ask_afresh()
            came = self.coordinator.present_inventories(attempt, self.shrink.wait_s, floor, self.gone)
        self._came = {attempt: came}
        return came

    def ask_afresh(self) -> None:
        """Each round probes the missing nodes anew: a node refused before may be back."""
        for endpoint in self.endpoints():
            self.probe.forget(endpoint)

    def gone(self, node: int) -> bool:
        """Whether ``node``'s rlsup is gone by its host's word (refused connects), not only silent."""
        endpoints = self.endpoints()
        return node < len(endpoints) and self.probe.gone(endpoints[node])

    def full_plan(self, attempt: int, inventories: list[NodeInventory], excluded: set[tuple[int, int, int]]) -> RoundPlan:
        """The newest step every part of which is somewhere: in the nodes' inventories, else (steps newer than
        those) with the persistent tier as the last holder of the parts it lists. Each step is planned once."""
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


class Succession:
    """Who leads each attempt's round in a job that may go on with fewer nodes and whose store outlives node 0:
    node 0 claims the attempt's lead (``lead/a``) before it plans, as it always leads; any other node claims it only
    when neither the plan nor node 0's inventory came within the shrink's wait (or node 0's endpoint refuses
    connects) and the job may go on without a node now (:meth:`RoundLead.floor_now`). The store's atomic create
    decides; the node that won plans (its :class:`RoundLead`), and the plan names it, so that every node knows who
    gathers the round, records the job's end, and grows the job back once node 0 returns."""

    def __init__(self, planner: RoundLead) -> None:
        self.planner = planner
        self.leads = False

    def publish_plan(self, attempt: int, plan_try: int, excluded: set[tuple[int, int, int]]) -> None:
        if plan_try == 0:
            self.leads = self._claims(attempt)
        if self.leads:
            self.planner.publish_plan(attempt, plan_try, excluded)

    def _claims(self, attempt: int) -> bool:
        planner = self.planner
        coordinator, me = planner.coordinator, planner.coordinator.node_rank
        if me != 0:
            held = coordinator.claim_lead(attempt, claim=False)
            if held == me:  # claimed by this node's rlsup before it was stopped or restarted: its plan is still owed
                return True
            if held is not None or planner.floor_now() is None:
                return self._follows(attempt)
            planner.ask_afresh()
            if not coordinator.plan_or_absent(attempt, 0, planner.shrink.wait_s, lambda: planner.gone(0),
                                              looks_from_s=min(PROBE_AFTER_S, planner.shrink.wait_s)):
                return self._follows(attempt)
        lead = coordinator.claim_lead(attempt)
        if lead == me and me != 0:
            planner.say(f"attempt {attempt}: node 0 is missing from the round (nothing from it within "
                        f"spare_takeover_s, or its endpoint refuses connects; no spare left, min_nodes "
                        f"{planner.shrink.min_nodes}); node {me} leads the round in its place")
        return lead == me or self._follows(attempt)

    def _follows(self, attempt: int) -> bool:
        """Another node leads ``attempt``: wait for its plan, and when the job may go on with fewer nodes and the lead
        is gone before its plan (its endpoint refuses connects: it died in the round, or claimed in a run that is over),
        end the attempt, so that the next one's round has a lead. False (this node does not lead)."""
        planner = self.planner
        coordinator = planner.coordinator
        if planner.floor_now() is None:
            return False  # nobody may take its place: wait for its plan as always
        lead = coordinator.lead_of(attempt)
        planner.ask_afresh()
        if coordinator.plan_or_absent(attempt, None, math.inf, lambda: planner.gone(lead),
                                      looks_from_s=planner.shrink.wait_s):
            why = f"node {coordinator.node_rank}: node {lead}, the lead of attempt {attempt}, is gone before its plan"
            raise RoundEnded(f"attempt {attempt} ended: {coordinator.end(attempt, why)}")
        return False

    def note_bad(self, parts: set[Part]) -> None:
        self.planner.note_bad(parts)

    def launched(self, plan: RoundPlan) -> None:
        self.planner.launched(plan)

    def joined_running(self) -> None:
        self.planner.joined_running()

    def finish_job(self, job_end: JobEndWatch | None, last_attempt: int) -> None:
        if self.leads:
            self.planner.finish_job(job_end, last_attempt)


def round_role(node_rank: int, coordinator: RoundCoordinator, persistent: PersistentTier | None,
               say: Callable[[str], None], shrink: ShrinkSettings = ShrinkSettings(),
               spares_left: Callable[[], int] = lambda: 0,
               endpoints: Callable[[], Sequence[str]] = lambda: (), store_outlives_node_0: bool = False) -> RoundRole:
    """Node 0 leads every round, the others follow; in a job that may go on with fewer nodes and whose store outlives
    node 0, each attempt's lead is claimed (:class:`Succession`)."""
    if store_outlives_node_0 and shrink.floor(coordinator.num_nodes) is not None:
        return Succession(RoundLead(coordinator, persistent, say, shrink, spares_left, endpoints))
    return RoundLead(coordinator, persistent, say, shrink, spares_left, endpoints) if node_rank == 0 else RoundMember()


__all__ = ["RoundRole", "RoundLead", "RoundMember", "ShrinkSettings", "Succession", "round_role"]
