"""``rlsup run`` on several nodes: coordinated restarts and one resume step for all, parts fetched from peers.

:class:`NodeGroup` is the run loop's collaborator for the job's other nodes (:class:`supervisor.run.peers.Peers`,
passed in: nothing of the loop is overridden; :mod:`supervisor.cluster.node_run` wires the two): the attempt
number comes from the coordinator (every node runs the same one), :meth:`NodeGroup.agree` agrees on the resume
step and fetches missing parts before launch, :meth:`NodeGroup.peer_ended` stops this node's job when another
node's attempt failed, and a failure here ends the attempt for all. Who plans the round is this node's role
(:mod:`supervisor.cluster.round_lead`: node 0 plans, the others read the plan), asked the same way on every node.

The persistent tier (``persistent_dir``) works per part here: each node copies the parts its own ranks
wrote (:class:`supervisor.tiers.persistent.PersistentTier`, built with this node's rank), and node 0 offers
the tier's parts to the plan as the last holder (in place > peer > persistent). A missing part is
fetched from its holders in plan order by one call, :func:`supervisor.tiers.part_protocol.fetch_part`.

The memory tier (``memory_dir``) is one more place a part can be: each node's tier holds its own
ranks' parts (:class:`supervisor.tiers.memory_tier.MemoryTier`, built with this node's rank) and offers them
in the node's inventory as parts in place, so the plan picks the newest step whose every part exists
somewhere (memory, disk, a peer's replica, the persistent tier). A node whose parts of that step are
all in its tier resumes its ranks from there, in place; otherwise its tier's parts are copied beside
the others in ``checkpoint_dir``. Retention of the tier waits while the nodes agree.

SIGTERM and the preemption signal end every wait of the nodes' agreement at once (the store's connect,
the joins, the round: :meth:`supervisor.stop_request.StopRequest.check`): the handlers are installed
before the store is reached, a stop inside a round ends that attempt for the other nodes, and the run
ends as any stop does (128+signal or 75, the attempt recorded as stopped or preempted, the tiers flushed).
"""

from __future__ import annotations


import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NoReturn

from supervisor.bounded_calls import BoundedCalls
from supervisor.tiers.holdings import PERSISTENT_HOLDER, FetchResult, InventoryBuilder, NodeInventory, RoundPlan
from supervisor.cluster import grow_back
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.round_errors import RoundEnded
from supervisor.cluster.fr_exchange import FrExchange
from supervisor.cluster.kvstore import StoreUnavailable
from supervisor.cluster.round_lead import RoundRole
from supervisor.lifecycle import EndReason
from supervisor.membership import Membership
from supervisor.observer import Observer
from supervisor.tiers.part_protocol import FetchFailed, PartError, PartStore, fetch_part
from supervisor.cluster.spares import (JobEnded, JobEndWatch, NodeRole, SpareSeat, check_holder, check_seat, job_done,
                                       moved_slots, spares_left)
from supervisor.launch.rank_pinning import resize_pinned
from supervisor.tiers.replication import ReplicationEngine, newest_own_step
from supervisor.tiers.resume import ResumePoint
from supervisor.diagnosis.evidence import EndedElsewhere
from supervisor.diagnosis.outcome import AttemptResult
from supervisor.run.loop import AttemptAbandoned, NodeTiers
from supervisor.run.peers import World
from supervisor.stop_request import StopAsked, StopRequest
from supervisor.tiers.resume import TIER_LOCAL, TIER_MEMORY, TIER_PEER, TIER_PERSISTENT, newest_step
from rlsup_format import job_env
from rlsup_format.manifest import ManifestError, manifest_name, step_dir_name

log = logging.getLogger(__name__)

# Plans per attempt: each failed try excludes at least one more (step, rank) from the persistent tier,
# so the attempt falls back to older steps; the bound only guards against a tier that fails everything.
PLAN_TRIES = 8
_TIER_ORDER = {TIER_MEMORY: -1, TIER_LOCAL: 0, TIER_PEER: 1, TIER_PERSISTENT: 2}


@dataclass
class _Fetched:
    """This node's side of one plan try."""

    result: FetchResult = field(default_factory=FetchResult)
    tier: str = TIER_LOCAL  # where this node's missing parts came from (the farthest tier used)
    ranks: list[int] = field(default_factory=list)  # parts fetched (dropped again if the step is abandoned)
    path: Path | None = None  # the step directory this node's ranks load (memory tier or checkpoint_dir)


GROW_POLL_S = 1.0  # how often a left-out node looks for the attempt's end, and the lead for its return and a save


@dataclass
class _BackWatch:
    """The lead's watch over a smaller world's attempt: when a left-out node came back, the newest step this node
    had saved then (the job grows at a later one)."""

    plan: RoundPlan
    saved_before: int | None = None
    next_look: float = 0.0


class NodeGroup:
    """The job's other nodes as this node's run loop sees them (:class:`supervisor.run.peers.Peers`), over the
    job's store (``coordinator``): built once the store is reached, with this node's tiers (shared with its loop),
    its part in planning (``role``), the Flight Recorder exchange and the run's stop request."""

    def __init__(self, membership: Membership, engine: ReplicationEngine, coordinator: RoundCoordinator,
                 role: RoundRole, flight_records: FrExchange, stop: StopRequest, tiers: NodeTiers,
                 checkpoint_dir: Path, state_dir: Path, say: Callable[[str], None], *, observer: Observer,
                 spares: SpareSeat | None = None, job_end: JobEndWatch | None = None) -> None:
        """``spares``: the job has spare nodes: this node's claim on its rank is checked at every join;
        ``job_end``: then, the watch for a job that finished without this node (:class:`JobEndWatch`)."""
        self.membership, self.engine, self.coordinator, self.role = membership, engine, coordinator, role
        self.fr_exchange, self.stop, self.observer = flight_records, stop, observer
        self.persistent, self.memory = tiers.persistent, tiers.memory
        self.known = tiers.known  # the restart's checksums: the marker's, reused by the inventory (the loop forgets them)
        self.checkpoint_dir, self.state_dir = checkpoint_dir, state_dir
        self._log = say
        self.spares, self.job_end = spares, job_end
        self._store_lost = False
        self._stopped_waiting: StopAsked | None = None  # the wait a stop ended before the attempt was known
        self._plan: RoundPlan | None = None  # the running attempt's plan (its nodes: fewer after a shrink)
        self._back: _BackWatch | None = None  # the lead's watch for a left-out node that is back (grow at a save)
        self._change = ""  # what the last agreed round did to the job's size (the incident's words)
        # the lead's look for a save to grow at, from the run loop's watch: a hung mount must not stop that watch
        self._own_saves = BoundedCalls(f"reading the checkpoint directory {checkpoint_dir}", 10.0, forked=True)

    @property
    def me(self) -> int:
        return self.membership.node_rank

    @property
    def size(self) -> int:
        return self.membership.size

    @property
    def flight_records(self) -> FrExchange:
        return self.fr_exchange

    def join(self, mine: int) -> int:
        """The attempt the nodes agree on; stopped while waiting, this node's own count: :meth:`agree`
        then abandons it at once and the loop records the stop."""
        try:
            if self.spares is not None:  # before joining: a node whose rank a spare took must not end the attempt
                check_seat(self.coordinator, self.membership.node_rank, self.spares.gen, self.job_end)
            attempt = self.coordinator.join(mine)
        except StopAsked as e:
            self._stopped_waiting = e
            return mine
        if self.spares is not None:
            self._follow_spares(self.spares)
        return attempt

    def _follow_spares(self, seat: SpareSeat) -> None:
        """Refuse to go on when a spare took this node's rank (:class:`SlotTaken`); send the replicas of a
        rank a spare took to the spare."""
        check_holder(self.coordinator, self.membership.node_rank, seat.gen)
        moved = moved_slots(self.coordinator, self.membership.size)
        for slot, claim in moved.items():
            if self.engine.move_peer(slot, claim.endpoint):
                self._log(f"node rank {slot} is now the spare at {claim.endpoint}")
        self.observer.node_role(NodeRole.WORKER.value, spares_left(seat.roster, moved))

    def agree(self, attempt: int, own_choice: Callable[[], ResumePoint | None]) -> ResumePoint | None:
        """:meth:`_agree_on_attempt` (this node's ``own_choice`` is not asked: the plan chooses); an attempt that
        ends meanwhile (a node failed its fetch, or died and its replacement rejoined) is abandoned before launch, and every node goes to the next attempt. A stop
        asked before or during the round abandons it too (the loop records the stop), and ends the attempt
        for the other nodes, which would otherwise wait for this one until ``rendezvous_timeout``."""
        try:
            if self._stopped_waiting is not None:
                raise self._stopped_waiting
            self.stop.check(f"attempt {attempt} to start")
        except StopAsked as e:
            raise AttemptAbandoned(str(e)) from e
        if self.memory is not None:
            self.memory.pause_retention(True)  # the tier's steps stay as inventoried until the plan is made
        try:
            resume = self._agree_on_attempt(attempt)
        except RoundEnded as e:
            raise AttemptAbandoned(str(e), e.reason) from e
        except StoreUnavailable as e:  # a call outside the round's waits (they end it themselves): the next join reconnects
            raise AttemptAbandoned(f"the coordination store {self.coordinator.describe()} is unreachable: {e}") from e
        except StopAsked as e:
            try:
                self.coordinator.end(attempt, f"node {self.membership.node_rank}: {e}")
            except Exception as err:  # noqa: BLE001 - the store is gone: the others' own waits end on that
                self._log(f"could not tell the other nodes that attempt {attempt} ended: {err}")
            raise AttemptAbandoned(str(e)) from e
        finally:
            if self.memory is not None:
                self.memory.pause_retention(False)
        if self.memory is not None:
            self.memory.protect(resume.path if resume is not None else None)
        return resume

    def _agree_on_attempt(self, attempt: int) -> ResumePoint | None:
        """Publish what we hold; node 0 plans; fetch what we lack; start together.

        A persistent part that fails verification does not end the attempt: every node reports its
        fetch, and node 0 plans again without the bad parts (an older step, or a fresh start), so one
        corrupted copy costs a re-plan, not a restart. Any other fetch failure ends the attempt for
        everyone, as before: the next attempt plans from fresh, fully verified inventories."""
        me = self.membership.node_rank
        self.coordinator.publish_inventory(attempt, self._inventory())
        excluded: set[tuple[int, int, int]] = set()
        fetched: dict[int, set[int]] = {}
        resume: ResumePoint | None = None
        for plan_try in range(PLAN_TRIES):
            self.role.publish_plan(attempt, plan_try, excluded)  # node 0 plans; the others read its plan
            plan = self.coordinator.plan(attempt, plan_try)
            if not plan.runs(me):
                self._wait_to_grow(attempt, plan)
            mine = self._fetch(attempt, plan)
            if plan.step is not None:
                fetched.setdefault(plan.step, set()).update(mine.ranks)
            if mine.result.error:  # before anyone can launch: the attempt is over for all
                self._log(f"attempt {attempt}: {mine.result.error}")
                self.coordinator.end(attempt, f"node {me}: fetch failed: {mine.result.error}")
            self.coordinator.publish_fetch_result(attempt, plan_try, mine.result)
            results = self.coordinator.fetch_results(attempt, plan_try)
            bad = {b for r in results for b in r.bad}
            self.role.note_bad(bad)
            if errors := "; ".join(r.error for r in results if r.error):
                # Ended by the failing node, and here too: a result that did not parse names no node that
                # would end it itself (ending is first-writer-wins). The next attempt plans afresh.
                why = self.coordinator.end(attempt, f"node {me}: fetch failed: {errors}")
                raise RoundEnded(f"attempt {attempt} ended: {why}")  # never on to ready: see below
            if not bad:
                if plan.step is None:
                    self._log(f"attempt {attempt}: no step is complete across the nodes and tiers; starting fresh")
                else:
                    resume = ResumePoint(plan.step, mine.path or self.checkpoint_dir / step_dir_name(plan.step),
                                         "rlsup", mine.tier)
                self._drop_abandoned(fetched, plan.step)
                break
            self._log(f"attempt {attempt}: persistent parts (step, rank) {sorted(bad)} do not verify; "
                      "planning again without them")
            excluded |= {(s, r, PERSISTENT_HOLDER) for s, r in bad}
        else:
            why = self.coordinator.end(attempt, f"node {me}: no usable plan after {PLAN_TRIES} tries")
            # An ended attempt never reaches mark_ready: a wait returns once all its keys exist, so a node that
            # looked late would find every ready mark and launch (from scratch) in an attempt that is over.
            raise RoundEnded(f"attempt {attempt} ended: {why}")
        if self.spares is not None:  # a spare may have taken this rank while this node was late to the round
            check_holder(self.coordinator, me, self.spares.gen)
        self.coordinator.mark_ready(attempt)
        self.coordinator.wait_all_ready(attempt)
        self._world(attempt, plan)  # every node of the plan is ready: what the round did to the job's size is true
        if self.spares is not None:  # a spare that took a rank in this round is in it now: replicate to it
            self._follow_spares(self.spares)
        if self.persistent is not None:
            # Every node has fetched what it needed: the resumed step is local everywhere now, so the
            # tier's retention may treat it like any other step again (it used to pin it for the whole run).
            self.persistent.protect(None)
        return resume

    def _inventory(self) -> NodeInventory:
        """What this node holds: its checkpoint directory and replicas, plus the valid parts in its
        memory tier as parts in place (a part in both is listed once). Files the progress marker hashed since
        the failure, unchanged since, are not hashed again (``known``)."""
        inventory = self.engine.inventory(known=self.known)
        if self.memory is None:
            return inventory
        merged = InventoryBuilder(self.membership.node_rank)
        merged.add_inventory(inventory)
        merged.add_inventory(self.memory.inventory(known=self.known))
        return merged.build()

    def _fetch(self, attempt: int, plan: RoundPlan) -> _Fetched:
        """Fetch this node's missing parts of the planned step, each from its holders in plan order."""
        out = _Fetched()
        need: dict[int, list[int]] = plan.fetch.get(self.membership.node_rank, {}) if plan.step is not None else {}
        if need:
            self._log(f"attempt {attempt}: fetching ranks {sorted(need)} of step {plan.step} "
                      f"({self._describe(need)})")
            self.engine.clean()  # what a killed fetch left (temp files, spooled transfers)
        for rank, holders in sorted(need.items()):
            self.stop.check(f"step {plan.step}'s parts to be fetched")  # between parts (a part's copy runs to its end)
            tier, errors, bad = self._fetch_part(plan.step, rank, holders, plan.owners.get(rank))
            if tier is None:
                if bad:
                    out.result.bad.append((plan.step, rank))  # fall back to another plan
                else:
                    out.result.error = f"could not fetch step {plan.step} rank {rank}: {'; '.join(errors)}"
                break
            out.ranks.append(rank)
            out.tier = max(out.tier, tier, key=_TIER_ORDER.__getitem__)
        if plan.step is not None and self.memory is not None and not (out.result.error or out.result.bad):
            self._place(plan.step, out)
        return out

    def _place(self, step: int, out: _Fetched) -> None:
        """Where this node's ranks load ``step``: in place from the memory tier when all its parts are
        there (and none was fetched), else from ``checkpoint_dir``, with the tier's parts copied there."""
        in_memory = self.memory.resume_dir(step, self.known) if self.memory is not None and not out.ranks else None
        if in_memory is not None:
            out.path, out.tier = in_memory, TIER_MEMORY
            return
        try:
            copied = self.memory.copy_to_disk(step) if self.memory is not None else 0
        except (OSError, ManifestError, PartError) as e:
            out.result.error = f"could not copy step {step} from the memory tier to {self.checkpoint_dir}: {e}"
            return
        if copied:
            self._log(f"step {step}: {copied} part(s) copied from the memory tier to {self.checkpoint_dir}")

    def _fetch_part(self, step: int, rank: int, holders: list[int],
                    owner: int | None = None) -> tuple[str | None, list[str], bool]:
        """(tier it came from or None, errors, whether the persistent copy failed verification). ``owner``: the
        node whose ranks wrote the part, when not this one (a smaller or grown world's plan)."""
        tier_of: dict[PartStore, str] = {}  # the holders in plan order, each a store
        errors: list[str] = []
        for holder in holders:
            if holder != PERSISTENT_HOLDER and owner is not None:
                tier_of[self.engine.holder_store(holder, owner)] = TIER_LOCAL if holder == self.me else TIER_PEER
            elif holder != PERSISTENT_HOLDER:
                tier_of[self.engine.peer_store(holder)] = TIER_PEER
            elif self.persistent is not None:
                tier_of[self.persistent.store] = TIER_PERSISTENT
            else:
                errors.append("persistent tier: no persistent_dir configured on this node")
        stores, local, bad = list(tier_of), self.engine.local_store(), False
        while stores:  # in plan order; the persistent tier's copy in a bounded call of its own
            at = next((i for i, s in enumerate(stores) if tier_of[s] == TIER_PERSISTENT), len(stores))
            group, stores = (stores[:at], stores[at:]) if at else (stores[:1], stores[1:])
            persistent = self.persistent if tier_of[group[0]] == TIER_PERSISTENT else None

            def fetch(group: list[PartStore] = group) -> PartStore:
                return fetch_part(group, local, step, rank, accept=self.engine.accept)[0]
            try:
                used = fetch() if persistent is None else persistent.reads.call(fetch, None, lambda: persistent.moved)
            except FetchFailed as e:
                errors.append(str(e))
                bad = bad or any(tier_of[s] == TIER_PERSISTENT for s in e.invalid)
                continue
            if used is None:  # the tier stalled: its copy counts as failed, and the next plan leaves the tier out
                errors.append(f"persistent tier: {persistent.stalled() or 'not answering'}")
                bad = True
                continue
            return tier_of[used], errors, False
        return None, errors, bad

    @staticmethod
    def _describe(need: dict[int, list[int]]) -> str:
        first = {h[0] for h in need.values() if h}
        names = sorted("the persistent tier" if h == PERSISTENT_HOLDER else f"node {h}" for h in first)
        return "from " + ", ".join(names)

    def _drop_abandoned(self, fetched: dict[int, set[int]], keep: int | None) -> None:
        """Parts fetched for a step the attempt then abandoned lose their manifests (invalid again), so
        the trainer rewrites them when it reaches that step instead of mixing in the old ones."""
        for step, ranks in fetched.items():
            if step == keep:
                continue
            for rank in sorted(ranks):
                path = self.checkpoint_dir / step_dir_name(step) / manifest_name(rank)
                try:
                    path.unlink()
                    self._log(f"step {step}: dropped rank {rank}'s fetched part (that step is not used)")
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("could not drop %s: %s", path, e)

    def env(self) -> dict[str, str]:
        """This node's rank among the job's nodes (the one its parts are kept under, whatever torchrun's node rank
        after a shrink), the nodes that run the attempt, and the saving world's size when that changed."""
        plan = self._plan
        nodes = len(plan.nodes) if plan is not None and plan.nodes is not None else self.membership.size
        out = {job_env.NODE_RANK: str(self.membership.node_rank), job_env.NUM_NODES: str(nodes)}
        if plan is not None and plan.changes_world and plan.world_size is not None:
            out[job_env.PREVIOUS_WORLD_SIZE] = str(plan.world_size)
        return out

    def command(self, argv: list[str]) -> list[str]:
        """The launch line for this attempt: torchrun's node count and node rank are those of the nodes that run it
        (the i-th of them is node i), after a shrink or a grow; torchrun's master is on the first node that runs it
        when that is not node 0 as launched (node 0 lost, or a spare holding its rank: its host)."""
        plan, peers = self._plan, self.engine.membership.peers
        nodes = plan.nodes if plan is not None and plan.nodes is not None else tuple(range(self.size))
        moved = nodes[0] != 0 or peers[0] != self.membership.peers[0]
        if (plan is None or plan.nodes is None) and not moved:
            return argv
        master = peers[nodes[0]].rpartition(":")[0] if moved else None
        return resize_pinned(argv, nodes.index(self.me), len(nodes), master)

    def _world(self, attempt: int, plan: RoundPlan) -> None:
        """Says what the plan does to the job's size (on every node, the incident's words) and keeps the plan."""
        job, was = self.membership.size, self._plan
        nodes = len(plan.nodes) if plan.nodes is not None else job
        shrunk_before = was is not None and was.nodes is not None and len(was.nodes) < job
        self._change, why = "", ""
        if plan.changes_world and nodes < job:
            self._change = f"continued on {nodes} of {job} nodes from step {plan.step}"
            why = (f" (nodes {list(plan.nodes or ())}; node(s) {sorted(set(range(job)) - set(plan.nodes or ()))} "
                   "missing from the round past spare_takeover_s, no spare left; min_nodes allows it)")
        elif plan.changes_world and nodes == job:
            self._change = f"grew back to {job} at step {plan.step}"
        elif shrunk_before and nodes == job:
            self._change = f"back to {job} nodes from step {plan.step}"
        if self._change:
            self._log(f"attempt {attempt}: {self._change}{why}")
        self._plan = plan
        self.role.launched(plan)
        if self.persistent is not None:
            self.persistent.lead(self.role.leads)
        self._back = _BackWatch(plan) if self.role.leads and nodes < job else None

    def world(self) -> World:
        """The nodes that run the agreed attempt, of the job's, and what its round changed."""
        plan = self._plan
        nodes = len(plan.nodes) if plan is not None and plan.nodes is not None else self.membership.size
        return World(nodes, self.membership.size, self._change)

    def _wait_to_grow(self, attempt: int, plan: RoundPlan) -> NoReturn:
        """This node is left out of a smaller world (it was lost, and is back): it says so, and waits for the
        attempt to end (the lead ends it at the job's next save, and the next round grows the job to every node)."""
        self._log(f"attempt {attempt}: the job goes on with nodes {list(plan.nodes or ())} without this node; "
                  "waiting for its next save to grow back")
        grow_back.mark_back(self.coordinator, attempt)
        self.role.joined_running()
        if self.persistent is not None:
            self.persistent.lead(False)  # the lead of the smaller world starts and prunes the tier's steps
        unreachable_since: float | None = None
        while True:
            if self.stop.asked:  # this node's stop is its own: the attempt the others run goes on
                raise RoundEnded(f"asked to stop while waiting to grow back into attempt {attempt}")
            if self.job_end is not None and (over := self.job_end.over()) is not None:
                raise JobEnded(over)  # the job finished (its store may be gone with node 0)
            try:
                ending = self.coordinator.ending(attempt)
                # a success there is one node's: the job's end is node 0's word (job_done, the job-end record), and
                # node 0 may yet fail and go on (then this node joins the next attempt)
                if ending is not None and (ending[1] is not EndReason.SUCCESS or grow_back.moved_on(self.coordinator, attempt)):
                    raise RoundEnded(f"attempt {attempt} ended: {ending[0]}", ending[1] if ending[1] is not
                                     EndReason.SUCCESS else EndReason.PEER_FAILURE)
                if job_done(self.coordinator):
                    raise JobEnded(f"the coordination store {self.coordinator.describe()} says the job finished "
                                   "without this node")
                unreachable_since = None
            except StoreUnavailable as e:
                if self.job_end is None:
                    raise
                try:  # a stalled connection is replaced (a bounded try every few seconds), as the watch does
                    self.coordinator.reach_again()
                except StoreUnavailable:
                    pass
                # gone with node 0, with no record of the job's end: after rendezvous_timeout, this attempt is over
                # for this node too (the next join waits for the store, then exits for a requeue)
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > self.coordinator.timeout_s:
                    raise RoundEnded(f"the coordination store {self.coordinator.describe()} stayed unreachable for "
                                     f"{self.coordinator.timeout_s:.0f}s while waiting to grow back into attempt "
                                     f"{attempt}: {e}") from e
            self.stop.wait(GROW_POLL_S, GROW_POLL_S)

    def peer_ended(self, attempt: int, grow: bool = True) -> EndedElsewhere | None:
        """Another node's end of the attempt (or, on the lead of a smaller world, its own end of it to grow back:
        :class:`_BackWatch`). A store that stopped answering is reached again
        (:meth:`RoundCoordinator.reach_again`: a bounded try every few seconds), so a stall does not leave the
        watch blind until the next join; meanwhile this node's own job decides."""
        try:
            try:
                ending = self.coordinator.ending(attempt)
            except StoreUnavailable as e:
                if not self._store_lost:
                    self._store_lost = True
                    self._log(f"the coordination store {self.coordinator.describe()} is unreachable ({e}); watching "
                              "this node's job only until it answers again")
                if not self.coordinator.reach_again():  # nothing replaced (etcd): one blocking call per poll
                    return None
                ending = self.coordinator.ending(attempt)
            if ending is None and grow and self._back is not None and self._grow_at_save(attempt, self._back):
                ending = self.coordinator.ending(attempt)
        except Exception:  # noqa: BLE001 - the store is gone (node 0 finished or was lost; etcd cut off), or a stop: the watch goes on
            over = self.job_end.over() if self.job_end is not None else None  # it finished without this node?
            return None if over is None else EndedElsewhere(EndReason.PEER_FAILURE, over)
        if self._store_lost:
            self._store_lost = False
            self._log(f"the coordination store {self.coordinator.describe()} answers again; watching the other nodes")
        if ending is not None and ending[1] is EndReason.SUCCESS:  # another node's ranks finished: so do this node's
            if self._back is not None and self._back.saved_before is not None:
                self._log(f"attempt {attempt}: {ending[0]} before the grow back; the job ends on "
                          f"{len(self._back.plan.nodes or ())} nodes")
                self._back = None
            return None
        return None if ending is None else EndedElsewhere(ending[1], ending[0])

    def attempt_succeeded(self, attempt: int) -> EndedElsewhere | None:
        """In a smaller world the lead may end the attempt to grow back at the save this success follows (the job's
        last): the success claims the attempt's one end (:meth:`RoundCoordinator.end_succeeded`), and loses only to
        a grow that came first. A store out of reach leaves the success as it is (node 0 may be gone, done)."""
        plan = self._plan
        if plan is None or plan.nodes is None or len(plan.nodes) >= self.membership.size:
            return None  # every node runs: no grow to race with
        try:
            self.coordinator.end_succeeded(attempt, f"node {self.me}: its ranks finished")
            ending = self.coordinator.ending(attempt)
        except Exception as e:  # noqa: BLE001 - the store is gone with node 0 (done) or out of reach
            self._log(f"attempt {attempt}: could not record its success with the other nodes ({e}); it stands")
            return None
        if ending is None or ending[1] is not EndReason.RESIZED:
            return None
        self._log(f"attempt {attempt}: the lead's grow back came before this node's success ({ending[0]}); "
                  "going on with every node")
        return EndedElsewhere(EndReason.RESIZED, ending[0])

    def _grow_at_save(self, attempt: int, watch: "_BackWatch") -> bool:
        """The lead of a smaller world: once a left-out node is back (:func:`supervisor.cluster.grow_back.back`) and this node's
        ranks saved a step after that, the attempt ends (``resized``) so that the next round grows the job (never
        mid-step: at a save). True once ended."""
        now = time.monotonic()
        if now < watch.next_look:
            return False
        watch.next_look = now + GROW_POLL_S
        try:
            if watch.saved_before is None:
                back = grow_back.back(self.coordinator, attempt, (n for n in range(self.membership.size) if not watch.plan.runs(n)))
                if not back:
                    return False
                saved = self._newest_own_save()
                if saved is None:
                    return False  # the directory did not answer: look again
                watch.saved_before = saved
                self._log(f"attempt {attempt}: node(s) {back} back; the job grows back to {self.membership.size} nodes "
                          f"at its next save (after step {watch.saved_before})")
                return False
            newest = self._newest_own_save()
            if newest is None or newest <= watch.saved_before or not self.engine.replicated(newest):
                return False  # no save since, or its parts not yet on a peer (the returning node fetches from there)
            why = (f"node {self.me}: a left-out node is back and step {newest} is saved: ending attempt {attempt} to "
                   f"grow back to {self.membership.size} nodes")
            self.coordinator.end_to_resize(attempt, why)
            return True
        except StoreUnavailable:
            return False


    def _newest_own_save(self) -> int | None:
        """The newest step this node's ranks saved (0: none), or None when the directory did not answer in time."""
        return self._own_saves.call(lambda: newest_own_step(self.checkpoint_dir, self.me, full=False) or 0, None)

    def attempt_failed(self, attempt: int, result: AttemptResult) -> None:
        if result.reason != EndReason.PEER_FAILURE:
            try:
                self.coordinator.end(attempt, f"node {self.membership.node_rank}: {result.reason} {result.detail}".strip())
            except Exception as e:  # noqa: BLE001 - the next join reports the unreachable store with its address
                self._log(f"could not tell the other nodes that attempt {attempt} failed: {e}")
        # The Flight Recorder's verdict across nodes was settled before the outcome was classified
        # (supervisor.run.attempt_watch.AttemptWatch.with_shared_flight).

    def give_up(self, reason: str) -> None:
        try:
            self.coordinator.abort(f"node {self.membership.node_rank}: {reason}")
        except Exception:  # noqa: BLE001 - the store may be gone with node 0; giving up locally is enough then
            pass

    def progress_marker(self, own_marker: Callable[[], int | None]) -> int | None:
        """The newest step of this node's own parts, by the one rule (:func:`supervisor.tiers.resume.newest_step`:
        checksums and all, kept for the inventory); ``own_marker``, one node's choice, is not asked."""
        on_disk = newest_own_step(self.checkpoint_dir, self.membership.node_rank, full=True, known=self.known)
        return newest_step(on_disk, self.memory)


__all__ = ["NodeGroup"]
