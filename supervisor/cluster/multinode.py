"""``rlsup run`` on several nodes: coordinated restarts and one resume step for all, parts fetched from peers.

Extends the single-node loop through its hooks only: the attempt number comes from the coordinator (every
node runs the same one), ``prepare`` agrees on the resume step and fetches missing parts before launch,
``peer_ended`` stops this node's job when another node's attempt failed, and a failure here ends the
attempt for all.

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from supervisor import exit_codes
from supervisor.config import SupervisorConfig
from supervisor.tiers.holdings import PERSISTENT_HOLDER, FetchResult, InventoryBuilder, NodeInventory, RoundPlan
from supervisor.cluster.coordinator import (
    CoordinationError,
    JobClash,
    NodeZeroRunning,
    PeerLost,
    RoundCoordinator,
    RoundEnded,
    compute_plan,
    embedded_coordinator,
)
from supervisor.cluster.fr_exchange import FrExchange
from supervisor.run.node_health import mark_repeat_offender
from supervisor.run.incidents import Incident
from supervisor.cluster.kvstore import OP_TIMEOUT_S, StoreUnavailable
from supervisor.job_identity import JobIdentity
from supervisor.lifecycle import EndReason, route
from supervisor.membership import Membership
from supervisor.observer import Observer
from supervisor.tiers.part_protocol import FetchFailed, PartError, PartStore, fetch_part
from supervisor.processes.job import ProcessLayer
from supervisor.launch.rank_pinning import pin_ranks
from supervisor.cluster.spares import (DONE_KEY, JobEnded, JobEndWatch, NodeRole, SpareSeat, check_holder, check_seat,
                               moved_slots, refuse_if_taken, spares_left)
from supervisor.tiers.replication import ReplicationEngine, newest_own_step
from supervisor.tiers.resume import ResumePoint
from supervisor.diagnosis.outcome import AttemptResult
from supervisor.run.loop import AttemptAbandoned, JobStatus, RunResult, Supervisor
from supervisor.stop_request import StopAsked, StopRequest
from supervisor.launch.warm_start import WarmStarts
from supervisor.tiers.resume import TIER_LOCAL, TIER_MEMORY, TIER_PEER, TIER_PERSISTENT
from rlsup_format.manifest import ManifestError, manifest_name, step_dir_name

log = logging.getLogger(__name__)

# Plans per attempt: each failed try excludes at least one more (step, rank) from the persistent tier,
# so the attempt falls back to older steps; the bound only guards against a tier that fails everything.
PLAN_TRIES = 8
# Node 0 of a job ended by another node's clash keeps its store up this long: a node of the *other* job that
# shares the port and connects late reads whose store it is and refuses, instead of waiting for a store
# that nobody will host again. A stop ends the wait at once.
CLASH_LINGER_S = 10.0
# A node that ends the first round for a lost peer clears its keys this long after (supervisor.cluster.liveness): by then
# every node of the round saw ``abort`` (each looks twice a second) or ends on its own lapse rule.
LOST_LINGER_S = 3.0
Connect = Callable[[StopRequest], RoundCoordinator]  # reaches the job's store; every wait asks the stop
_TIER_ORDER = {TIER_MEMORY: -1, TIER_LOCAL: 0, TIER_PEER: 1, TIER_PERSISTENT: 2}


@dataclass
class _Fetched:
    """This node's side of one plan try."""

    result: FetchResult = field(default_factory=FetchResult)
    tier: str = TIER_LOCAL  # where this node's missing parts came from (the farthest tier used)
    ranks: list[int] = field(default_factory=list)  # parts fetched (dropped again if the step is abandoned)
    path: Path | None = None  # the step directory this node's ranks load (memory tier or checkpoint_dir)


@dataclass(frozen=True)
class CoordinatorSettings:
    """The coordination store's part of the config (``coordinator_*`` keys and ``rendezvous_timeout``)."""

    backend: str = "embedded"
    endpoints: tuple[str, ...] = ()
    port: int = 9780
    rendezvous_timeout: float = 600.0

    @classmethod
    def from_config(cls, cfg: SupervisorConfig) -> "CoordinatorSettings":
        return cls(cfg.coordinator_backend, tuple(cfg.coordinator_endpoints), cfg.coordinator_port,
                   cfg.rendezvous_timeout)


def connect_coordinator(cfg: SupervisorConfig, membership: Membership, job: JobIdentity,
                        secret: bytes, stop: StopRequest | None = None,
                        gone_after_s: float | None = None, wait_s: float | None = None) -> RoundCoordinator:
    """This node's handle on the job's coordination store (``coordinator_backend``); ``stop`` ends its waits;
    ``gone_after_s``: see :func:`~supervisor.cluster.coordinator.embedded_coordinator` (etcd outlives node 0); ``wait_s``:
    the connect's window and the handle's waits instead of ``rendezvous_timeout`` (a spare's bounded reconnect)."""
    s = CoordinatorSettings.from_config(cfg)
    s = s if wait_s is None else replace(s, rendezvous_timeout=wait_s)
    if s.backend == "etcd":
        from supervisor.cluster.kvstore_etcd import EtcdKVStore

        try:
            store = EtcdKVStore(list(s.endpoints), timeout_s=min(30.0, s.rendezvous_timeout))
        except StoreUnavailable as e:
            raise CoordinationError(str(e)) from e
        return RoundCoordinator(store, job, secret, membership.node_rank, membership.size, s.rendezvous_timeout,
                                stop=stop, beat_store=lambda: EtcdKVStore(list(s.endpoints), timeout_s=OP_TIMEOUT_S))
    host = membership.peers[0].rpartition(":")[0]
    try:
        return embedded_coordinator(host, s.port, job, secret, membership.node_rank, membership.size,
                                    s.rendezvous_timeout, stop, gone_after_s)
    except NodeZeroRunning:
        if cfg.spares:
            refuse_if_taken(host, s.port, job, secret, membership.size, stop)
        raise


class MultiNodeSupervisor(Supervisor):
    keeps_file_versions = False  # see Supervisor: single-file checkpoints are a single node's
    def __init__(self, cfg: SupervisorConfig, command: Sequence[str], membership: Membership,
                 engine: ReplicationEngine, observer: Observer | None = None, *, job: JobIdentity,
                 coordinator: RoundCoordinator | None = None, connect: Connect | None = None,
                 processes: ProcessLayer | None = None, stopped_early: StopRequest | None = None,
                 spares: SpareSeat | None = None, warm: WarmStarts | None = None) -> None:
        """``coordinator``: the job's store, reached; or ``connect``, which :meth:`run` calls once the stop
        handlers are installed (SIGTERM while the store is awaited then stops rlsup as anywhere else).
        ``stopped_early``: the handlers the command line installed before this node's start-up (the
        service, this object): a stop they took is this run's. ``warm``: a spare's launcher, armed while it
        waited, used (and discarded at the end) instead of a fresh one: its first attempt here starts warm."""
        master = membership.peers[0].rpartition(":")[0]
        pinned = pin_ranks(command, membership.node_rank, membership.size, master)
        # The tiers are this node's (node 0 alone starts and prunes persistent steps; the memory tier holds
        # this node's own directory and ranks): the base class builds them once for this node.
        super().__init__(cfg, pinned.command, observer, job=job, processes=processes,
                         node_rank=membership.node_rank, num_nodes=membership.size)
        self.membership = membership
        self.engine = engine
        self._connect = connect
        self._stopped_early = stopped_early
        self.spares = spares  # the job has spare nodes: this node's claim on its rank is checked at every join
        if warm is not None:
            warm.adopt(self.command, self._log)
            self.warm = warm
        if pinned.note:
            self._log(pinned.note)
        self._store_lost = False
        self._stopped_waiting: StopAsked | None = None  # the wait a stop ended before the attempt was known
        # Node 0, the planner: persistent parts that failed verification, never offered again.
        self._bad_persistent: set[tuple[int, int]] = set()
        if coordinator is not None:
            self._use(coordinator)
        elif connect is None:
            raise ValueError("MultiNodeSupervisor needs a coordinator or a way to connect to one")

    def _use(self, coordinator: RoundCoordinator) -> None:
        self.coordinator = coordinator
        hosted = self.membership.node_rank == 0 and self.cfg.coordinator_backend == "embedded"
        self._log(f"node {self.membership.node_rank} of {self.membership.size}, job {self.job}: coordination store "
                  f"{coordinator.describe()}{' (hosted here)' if hosted else ''}")
        # A hang's Flight Recorder dumps meet on node 0, which judges them all (supervisor.cluster.fr_exchange).
        self.fr_exchange = FrExchange(coordinator, self.membership.node_rank, self.membership.size, self.node_name,
                                      self.observer, stopped=lambda: self.stop.asked)
        self.watcher.fr_share = self.fr_exchange
        seat = self.spares is not None  # a job with spares can finish without this node (supervisor.cluster.spares)
        self.job_end = JobEndWatch.attach(coordinator, self.checkpoint_dir, self.persistent, self.job) if seat else None

    def first_attempt(self) -> int:
        return self._join(super().first_attempt())

    def next_attempt(self, attempt: int) -> int:
        return self._join(attempt + 1)

    def _join(self, mine: int) -> int:
        """The attempt the nodes agree on; stopped while waiting, this node's own count: :meth:`prepare`
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

    def check_health(self, attempt: int) -> AttemptResult | None:
        return None if self.stop.asked else super().check_health(attempt)  # stopping: no pre_launch_check to wait for

    def record_incident(self, incident: Incident, downtime: float | None = None,
                        resume: ResumePoint | None = None) -> None:
        # A node that fails again is named only here, in a job of several nodes (the base names none).
        if incident not in self.incidents and mark_repeat_offender(incident, self.incidents, self.node_name,
                                                                   nodes=self.membership.size):
            self.observer.suspect(self.node_name, "repeated")
        super().record_incident(incident, downtime, resume)

    def run(self) -> RunResult:
        # The stop handlers from before the store is reached (super().run() installs them again and puts these
        # back): a connect that waits for node 0 is a wait like any other.
        previous = self.stop.install()
        if self._stopped_early is not None and self._stopped_early.signum is not None:  # read after install: none lost
            self.stop.note(self._stopped_early.signum, self._stopped_early.preempted)
        try:
            if self._connect is not None:
                try:
                    self._use(self._connect(self.stop))
                except StopAsked as e:
                    self._log(f"{e}; no attempt was started")
                    status = JobStatus.PREEMPTED if self.stop.preempted else JobStatus.STOPPED
                    return RunResult(e.exit_code, status, 0, [])
                self._connect = None
            try:
                result = super().run()
            except JobEnded as e:  # a spare ran this node's rank to the end: nothing to requeue
                self._log(f"{e}; exiting {exit_codes.OK} (the job succeeded without this node; nothing to requeue)")
                return self._gave_up_coordinating(e)
            except PeerLost as e:  # before the first attempt: nothing ran, nothing is lost; requeue the job
                self._log(f"{e}; exiting {exit_codes.REQUEUE} so that the scheduler requeues the job")
                done = self._gave_up_coordinating(e)
                self._forget_lost_round()
                return done
            except CoordinationError as e:
                self._gave_up_coordinating(e)
                if isinstance(e, JobClash):
                    self._linger_after_clash()
                raise
            except StopAsked:
                raise
            except Exception as e:
                self._tell_peers_of_error(e)
                raise
        finally:
            self._leave_first_round()
            self.stop.restore(previous)
        if result.status is JobStatus.SUCCEEDED:
            try:
                if self.membership.node_rank == 0:
                    if self.job_end is not None:  # for a node cut off until now, once the store is gone with this one
                        self.job_end.record(0, result.attempts - 1)  # the attempt that finished (attempts: a count)
                    self.coordinator.keys.set(DONE_KEY, "1")  # the spares' cue to exit
                self.coordinator.finish()  # a store that outlives the job (etcd) forgets its keys
            except Exception as e:  # noqa: BLE001 - the job is done; stale keys are ignored by the next run
                self._log(f"could not clear the job's coordination keys: {e}")
        return result

    def _gave_up_coordinating(self, e: CoordinationError) -> RunResult:
        """The nodes could not agree (a timeout, an abort, a clash, a node lost before the first attempt, the job
        over without this node): state.json says the run gave up, with the command line's exit code (2: a clash, 75:
        a lost node, the job is requeued, 0: the job finished without this node, 1 otherwise); the tiers take their
        final copy, as for any other give-up; a later start then does not take this run for one that died mid-attempt."""
        codes = {JobClash: exit_codes.CONFIG_ERROR, PeerLost: exit_codes.REQUEUE, JobEnded: exit_codes.OK}
        code = next((c for kind, c in codes.items() if isinstance(e, kind)), exit_codes.FAILED)
        try:
            for status in route(self.state.state, JobStatus.GAVE_UP):
                self.record.set_state(status, exit_code=code if status is JobStatus.GAVE_UP else None)
            return self._finish(code, JobStatus.GAVE_UP, self.state.attempt or 0, str(e))
        except Exception as err:  # noqa: BLE001 - recording is best effort: the error itself must reach the command line
            self._log(f"could not record the give-up: {err}")
            return RunResult(code, JobStatus.GAVE_UP, self.state.attempt or 0, list(self.incidents))

    def _tell_peers_of_error(self, e: Exception) -> None:
        """rlsup's own error (a bug, a deterministic crash) in the job's first round ends the job for every node
        as a give-up (exit 1), naming this node and the error: without a word its peers would take it for a node
        lost in the first round (exit 75, requeued for ever). A node that vanishes without a word (SIGKILL,
        power) is still a lost one; so is a node whose rlsup fails once the job has run: a replacement or a spare
        takes its place, as for any lost node."""
        coordinator = getattr(self, "coordinator", None)
        if coordinator is None or not coordinator.first_round:
            return
        why = f"node {self.membership.node_rank}: rlsup failed: {type(e).__name__}: {e}"
        self._log(f"{why}; ending the job for every node")
        try:
            coordinator.abort(why)
        except Exception as err:  # noqa: BLE001 - the store is gone: the peers' own waits end on that
            self._log(f"could not tell the other nodes: {err}")

    def _leave_first_round(self) -> None:
        """A run that ends inside the job's first round (a stop, a give-up, an error) deletes this node's beat:
        a requeued run in a store that outlives this one (etcd) must not count it (:mod:`supervisor.cluster.liveness`)."""
        coordinator = getattr(self, "coordinator", None)
        if coordinator is None or not coordinator.first_round:
            return
        try:
            coordinator.end_first_round(clear=True)
        except Exception as e:  # noqa: BLE001 - the store is gone (the embedded one goes with node 0): nothing stays
            self._log(f"could not delete this node's liveness beat: {e}")

    def _forget_lost_round(self) -> None:
        """After :class:`PeerLost`: wait :data:`LOST_LINGER_S` (every node looks at ``abort`` twice a second), then
        clear the round's keys (:meth:`RoundCoordinator.forget_first_round`). A stop ends the wait at once."""
        self.stop.wait(LOST_LINGER_S, self.settings.poll_interval)
        try:
            self.coordinator.forget_first_round()
        except Exception as e:  # noqa: BLE001 - the store is gone: the embedded one took its keys with it
            self._log(f"could not clear the first round's keys: {e}")

    def _linger_after_clash(self) -> None:
        """Node 0 of the embedded store, ended by another node's clash: see :data:`CLASH_LINGER_S`."""
        if self.membership.node_rank == 0 and self.cfg.coordinator_backend == "embedded":
            self._log(f"a node of this job refused to start for a clash; keeping the store up {CLASH_LINGER_S:.0f}s "
                      "so that the other job's nodes that reach it learn whose it is")
            self.stop.wait(CLASH_LINGER_S, self.settings.poll_interval)

    def prepare(self, attempt: int) -> ResumePoint | None:
        """:meth:`_agree_on_attempt`; an attempt that ends meanwhile (a node failed its fetch, or died and its
        replacement rejoined) is abandoned before launch, and every node goes to the next attempt. A stop
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
            raise AttemptAbandoned(str(e)) from e
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
            if me == 0:
                self.coordinator.publish_plan(self._make_plan(attempt, excluded), plan_try)
            plan = self.coordinator.plan(attempt, plan_try)
            mine = self._fetch(attempt, plan)
            if plan.step is not None:
                fetched.setdefault(plan.step, set()).update(mine.ranks)
            if mine.result.error:  # before anyone can launch: the attempt is over for all
                self._log(f"attempt {attempt}: {mine.result.error}")
                self.coordinator.end(attempt, f"node {me}: fetch failed: {mine.result.error}")
            self.coordinator.publish_fetch_result(attempt, plan_try, mine.result)
            results = self.coordinator.fetch_results(attempt, plan_try)
            bad = {b for r in results for b in r.bad}
            if me == 0:
                self._bad_persistent |= bad
            if errors := "; ".join(r.error for r in results if r.error):
                # Ended by the failing node, and here too: a result that did not parse names no node that
                # would end it itself (ending is first-writer-wins). The next attempt plans afresh.
                self.coordinator.end(attempt, f"node {me}: fetch failed: {errors}")
                break
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
            self.coordinator.end(attempt, f"node {me}: no usable plan after {PLAN_TRIES} tries")
        if self.spares is not None:  # a spare may have taken this rank while this node was late to the round
            check_holder(self.coordinator, me, self.spares.gen)
        self.coordinator.mark_ready(attempt)
        self.coordinator.wait_all_ready(attempt)
        if self.spares is not None:  # a spare that took a rank in this round is in it now: replicate to it
            self._follow_spares(self.spares)
        if self.persistent is not None:
            # Every node has fetched what it needed: the resumed step is local everywhere now, so the
            # tier's retention may treat it like any other step again (it used to pin it for the whole run).
            self.persistent.protect(None)
        return resume

    def _inventory(self) -> NodeInventory:
        """What this node holds: its checkpoint directory and replicas, plus the valid parts in its
        memory tier as parts in place (a part in both is listed once)."""
        inventory = self.engine.inventory()
        if self.memory is None:
            return inventory
        merged = InventoryBuilder(self.membership.node_rank)
        merged.add_inventory(inventory)
        merged.add_inventory(self.memory.inventory())
        return merged.build()

    def _make_plan(self, attempt: int, excluded: set[tuple[int, int, int]]) -> RoundPlan:
        """Node 0: plan from the inventories, then offer the persistent tier's parts of newer steps."""
        inventories = self.coordinator.inventories(attempt)
        exclude = excluded | {(s, r, PERSISTENT_HOLDER) for s, r in self._bad_persistent}
        plan = compute_plan(attempt, inventories, exclude=exclude)
        if self.persistent is None:
            return plan
        tier, listing = self.persistent, None
        if (stalled := tier.stalled()) is None:
            try:  # a bounded read: a tier that hangs right now must not hold the round (nor a SIGTERM)
                listing = tier.reads.call(lambda: tier.part_listing(newer_than=plan.step, exclude=self._bad_persistent),
                                          None)
            except Exception as e:  # noqa: BLE001 - an unreachable tier must not stop a restart from peers or local parts
                self._log(f"attempt {attempt}: persistent tier {tier.location} not listed: {e}")
                listing = {}
            stalled = tier.stalled() if listing is None else None
        if stalled is not None:
            self._log(f"attempt {attempt}: persistent tier not consulted for the plan: {stalled}")
        if listing:
            plan = compute_plan(attempt, inventories, listing, exclude)
        self.persistent.protect(plan.step)  # retention keeps the step the nodes are about to fetch
        return plan

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
            tier, errors, bad = self._fetch_part(plan.step, rank, holders)
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
        in_memory = self.memory.resume_dir(step) if self.memory is not None and not out.ranks else None
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

    def _fetch_part(self, step: int, rank: int, holders: list[int]) -> tuple[str | None, list[str], bool]:
        """(tier it came from or None, errors, whether the persistent copy failed verification)."""
        tier_of: dict[PartStore, str] = {}  # the holders in plan order, each a store
        errors: list[str] = []
        for holder in holders:
            if holder != PERSISTENT_HOLDER:
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

    def attempt_env(self, attempt: int, resume: ResumePoint | None, hb_dir: Path) -> dict[str, str]:
        env = super().attempt_env(attempt, resume, hb_dir)
        env["RLSUP_NODE_RANK"] = str(self.membership.node_rank)
        env["RLSUP_NUM_NODES"] = str(self.membership.size)
        return env

    def peer_ended(self, attempt: int) -> str | None:
        """Another node's end of the attempt. A store that stopped answering is reached again
        (:meth:`RoundCoordinator.reach_again`: a bounded try every few seconds), so a stall does not leave the
        watch blind until the next join; meanwhile this node's own job decides."""
        try:
            try:
                ended = self.coordinator.ended(attempt)
            except StoreUnavailable as e:
                if not self._store_lost:
                    self._store_lost = True
                    self._log(f"the coordination store {self.coordinator.describe()} is unreachable ({e}); watching "
                              "this node's job only until it answers again")
                if not self.coordinator.reach_again():  # nothing replaced (etcd): one blocking call per poll
                    return None
                ended = self.coordinator.ended(attempt)
        except Exception:  # noqa: BLE001 - the store is gone (node 0 finished or was lost; etcd cut off), or a stop: the watch goes on
            return self.job_end.over() if self.job_end is not None else None  # it finished without this node?
        if self._store_lost:
            self._store_lost = False
            self._log(f"the coordination store {self.coordinator.describe()} answers again; watching the other nodes")
        return ended

    def attempt_failed(self, attempt: int, result: AttemptResult) -> None:
        if result.reason != EndReason.PEER_FAILURE:
            try:
                self.coordinator.end(attempt, f"node {self.membership.node_rank}: {result.reason} {result.detail}".strip())
            except Exception as e:  # noqa: BLE001 - the next join reports the unreachable store with its address
                self._log(f"could not tell the other nodes that attempt {attempt} failed: {e}")
        attempt_dir = self.state_dir / "attempts" / f"attempt_{attempt:04d}"  # (RunRecord.attempt_dir makes a fresh one)
        self.fr_exchange.settle(attempt, result, attempt_dir if attempt_dir.is_dir() else None)  # before the incident

    def give_up(self, reason: str) -> None:
        try:
            self.coordinator.abort(f"node {self.membership.node_rank}: {reason}")
        except Exception:  # noqa: BLE001 - the store may be gone with node 0; giving up locally is enough then
            pass

    def progress_marker(self) -> int | None:
        on_disk = newest_own_step(Path(self.cfg.checkpoint_dir), self.membership.node_rank)
        in_memory = self.memory.newest_valid(full=False) if self.memory is not None else None
        if in_memory is not None and (on_disk is None or in_memory[0] > on_disk):
            return in_memory[0]
        return on_disk


__all__ = ["MultiNodeSupervisor", "CoordinationError"]
