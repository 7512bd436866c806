"""``rlsup run`` on a spare node: wait for a lost node (:mod:`supervisor.cluster.spares`), then run as that node.

The spare connects to the job's store as an observer (signing as its own index in ``peers``), watches the
rounds, claims a lost slot, and hands over to the ordinary node run (``run_node``) with the slot's
membership; the replicas of the slot are fetched by the round as a replacement node's are.

While it waits, the spare holds its first attempt's warm launcher (:mod:`supervisor.launch.warm_start`: torchrun
imported, ``nproc_per_node`` warm ranks with torch imported), armed with the start-up environment every
attempt gets (:func:`supervisor.run.loop.launch_env`), and hands it to the node run: a takeover does not pay a
cold start (a fresh interpreter and ``import torch`` in torchrun and in every rank) after the loss.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from supervisor import exit_codes
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.round_errors import CoordinationError, JobClash, PeerLost
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.cluster.endpoint_probe import all_gone
from supervisor.job_identity import JobIdentity
from supervisor.cluster.kvstore import StoreUnavailable
from supervisor.cluster.liveness import LIVENESS_LAPSE_S
from supervisor.cluster.job_store import CoordinatorSettings
from supervisor.membership import Membership
from supervisor.observer import Observer
from supervisor.processes.job import OsProcesses
from supervisor.processes.layer import Processes
from supervisor.run.settings import RunSettings
from supervisor.run.loop import launch_env
from supervisor.cluster.spares import (Claim, JobEnd, JobEndLookout, NodeRole, Roster, SpareSeat, StoreLostBeforeFirstAttempt,
                              job_end_places, moved_slots, spares_left, taken_over, try_claim, watch_for_slot)
from supervisor.stop_request import StopAsked, StopRequest
from supervisor.tiers.part_stores.fsspec_store import is_url
from supervisor.tiers.persistent import PersistentSettings
from supervisor.launch.warm_start import WarmStarts

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

log = logging.getLogger(__name__)

# (membership of the slot taken, the seat, the store when this spare hosts it, the armed launcher, the layer that
# guards it) -> exit code
RunNode = Callable[[Membership, SpareSeat, RoundCoordinator | None, WarmStarts, Processes], int]
# (the spare's view, the stop, gone_after_s: a store that answered and then refuses this long raises StoreGone,
# wait_s: how long to wait for the store, None for rendezvous_timeout)
Connect = Callable[[Membership, StopRequest, float, "float | None"], RoundCoordinator]


@dataclass(frozen=True)
class SpareSettings:
    """What a waiting spare reads of the config: its first attempt's launch (``run``: the warm launcher and its
    environment, the directories), the job's store (``store``: reached, or hosted in node 0's place), its turn
    (``takeover_s``: ``spare_takeover_s``) and the persistent tier (``persistent``, None when off), where node 0
    may record the job's end."""

    run: RunSettings
    store: CoordinatorSettings
    takeover_s: float
    persistent: PersistentSettings | None

    @classmethod
    def from_config(cls, cfg: SupervisorConfig, node_rank: int, job: str) -> "SpareSettings":
        """``node_rank``: the spare's index in ``peers``; ``job``: the job's identity (its persistent directory)."""
        cfg = cfg.resolved()
        return cls(RunSettings.from_config(cfg), CoordinatorSettings.from_config(cfg), cfg.spare_takeover_s,
                   PersistentSettings.from_config(cfg, node_rank, job))


@dataclass
class SpareRun:
    """One spare process: its roster place, how to reach the store, and the node run it becomes."""

    settings: SpareSettings
    roster: Roster
    node_rank: int
    job: JobIdentity
    secret: bytes
    connect: Connect
    stop: StopRequest
    observer: Observer
    command: Sequence[str] = ()  # the job's command (as typed: the node run pins it to the rank taken)
    seen_attempt: bool = False  # a watch saw an attempt of the job (kept across reconnects)
    first_round_lost_at: float | None = None  # monotonic: the store went away before any attempt was seen
    started: float = field(default_factory=time.time)  # wall clock: a JobEnd record older than this is an earlier run's
    places: tuple[Path, ...] = ()  # where node 0 records the job's end (set by run(): supervisor.cluster.spares.JobEnd)

    def run(self, run_node: RunNode) -> int:
        self.observer.node_role(NodeRole.SPARE.value, self.roster.spares)
        settings = self.settings.run
        self.places = self._job_end_places(settings.checkpoint_dir)
        processes = OsProcesses()
        warm: WarmStarts | None = None
        try:
            self._guard(processes, settings.state_dir)
            warm = self._warm_up(settings)
            try:
                taken = self._wait_for_slot()
            except StopAsked as e:
                log.info("spare %s: %s; it took no node rank", self.roster.peers[self.node_rank], e)
                return e.exit_code
            except (StoreLostBeforeFirstAttempt, PeerLost) as e:
                log.info("spare %s: %s: a node was lost before the job's first attempt; every node exits %d (requeue "
                         "the job), this spare too, having taken no node rank", self.roster.peers[self.node_rank], e,
                         exit_codes.REQUEUE)
                return exit_codes.REQUEUE
            except JobClash as e:
                log.error("spare %s: %s", self.roster.peers[self.node_rank], e)
                return exit_codes.CONFIG_ERROR
            except JobOver as e:  # exit 0 is the job's success, from every node: not this spare's to say
                log.warning("spare %s: %s; this spare took no node rank and saw no sign that the job finished (no "
                            "'done', no record of its end in %s): exit %d", self.roster.peers[self.node_rank], e,
                            ", ".join(map(str, self.places)) or "-", exit_codes.FAILED)
                return exit_codes.FAILED
            except StoreUnavailable as e:  # after a claim (the store went away while this spare took the rank)
                log.error("spare %s: %s", self.roster.peers[self.node_rank], e)
                return exit_codes.FAILED
            if taken is None:
                log.info("spare %s: the job ended without needing this spare", self.roster.peers[self.node_rank])
                return exit_codes.OK
            claim, membership, hosted = taken
            return run_node(membership, SpareSeat(self.roster, claim.gen), hosted, warm, processes)
        finally:
            try:
                if warm is not None:
                    warm.discard()  # every way out, errors included: the spare's launcher never outlives it
            finally:
                processes.release_attempts()  # the node run released it already when it ran (the same layer)

    def _guard(self, processes: Processes, state_dir: Path) -> None:
        """Guard the attempts from before the launcher is armed, as the node run would (its cgroup, the record a
        successor rlsup and the guardian end it from): the launcher becomes the first attempt's job root. A dead
        predecessor's leftovers are ended first. The node run is handed this layer, so its end (an error
        included) ends what it left exactly as on any node."""
        leftovers = processes.end_predecessor(state_dir)
        if leftovers is not None and leftovers[1]:
            log.info("spare %s: a previous rlsup (pid %d) died; ended what its attempt left: %s",
                     self.roster.peers[self.node_rank], leftovers[0], ", ".join(map(str, leftovers[1])))
        processes.guard_attempts(state_dir)

    def _warm_up(self, settings: RunSettings) -> WarmStarts:
        """The first attempt's launcher, armed now (``warm_launcher`` on, a torchrun command): the loss of a node
        is then followed by a warm start on this spare, as a restart on the other nodes is."""
        warm = WarmStarts(self.command, settings.warm_launcher, settings.warm_imports,
                          lambda line: log.info("spare %s: %s", self.roster.peers[self.node_rank], line),
                          settings.warm_cuda, settings.warm_fork)
        warm.arm(launch_env(settings), budget_left=True)
        return warm

    def _wait_for_slot(self) -> tuple[Claim, Membership, RoundCoordinator | None] | None:
        """The claim, the slot's membership and (node 0 re-hosted here) the store; None: the job is done."""
        watcher_view = Membership(self.roster.peers, self.node_rank)
        while True:
            watching = False
            try:
                # Inside the try: node 0 can be lost before this spare's first connect got in (a slow start, a
                # resolver that holds torch's connect); a store that answered and then went away is that loss.
                coordinator = self.connect(watcher_view, self.stop, self.settings.takeover_s,
                                           self._first_round_wait())
                self.first_round_lost_at = None  # reached (again): whatever happened was a stall
                watching = True
                # etcd outlives node 0: an attempt seen by an earlier watch still counts (its keys gone = the job
                # is done); a store a spare hosted afresh has no attempt of its own yet.
                carried = self.seen_attempt and self.settings.store.backend != "embedded"
                claim, lost_at = watch_for_slot(coordinator, self.roster, self.node_rank, self.settings.takeover_s,
                                                self.stop, self.seen_attempt, carried)
            except StoreLostBeforeFirstAttempt:
                self.first_round_lost_at = self.first_round_lost_at or time.monotonic()
                log.info("spare %s: the coordination store went away before the job's first attempt; giving it %.0fs "
                         "to come back, as the job's nodes do", self.roster.peers[self.node_rank], LIVENESS_LAPSE_S)
                continue  # reconnect within what is left of the lapse (_first_round_wait)
            except (StoreUnavailable, CoordinationError) as e:
                if self.first_round_lost_at is not None:  # not back within the lapse: node 0 was lost
                    raise StoreLostBeforeFirstAttempt(str(e)) from e
                if not isinstance(e, StoreUnavailable):
                    raise
                self.seen_attempt = self.seen_attempt or watching  # the watch saw an attempt (it says so by the class)
                try:
                    hosted = self._host_store()
                except JobOver:
                    end = self._job_end()
                    if end is None:
                        raise  # every node stopped, and none recorded that the job finished: not a success
                    log.info("spare %s: %s", self.roster.peers[self.node_rank], end.describe())
                    return None
                if hosted is None:
                    continue  # someone else hosts it now: connect to it and watch again
                claim = try_claim(hosted, 0, self.roster.peers[self.node_rank], 0)  # a fresh store
                if claim is None:
                    continue
                return claim, self._took(claim, hosted, "hosting the coordination store", None), hosted
            if claim is None:
                return None
            return claim, self._took(claim, coordinator, "", lost_at), None

    def _job_end_places(self, checkpoint_dir: Path) -> tuple[Path, ...]:
        """Where node 0 records the job's end, as a slot holder's :class:`~supervisor.cluster.spares.JobEndWatch` reads
        them: the checkpoint directory, and the persistent tier's directory for the job when it is local."""
        tier = self.settings.persistent
        local = tier is not None and not is_url(tier.location)
        return job_end_places(checkpoint_dir, Path(tier.location.removeprefix("file://")) if local else None)

    def _job_end(self) -> JobEnd | None:
        """Node 0's record that this run of the job finished (written after this spare started), or None; each
        place read in a bounded call (a hung mount is left behind)."""
        return JobEndLookout(self.places, self.job, self.secret, self.started, every_s=0.0).look()

    def _first_round_wait(self) -> float | None:
        """How long a connect may wait: what is left of :data:`LIVENESS_LAPSE_S` once the store went away before
        the first attempt (None: ``rendezvous_timeout``, as any node's first connect)."""
        if self.first_round_lost_at is None:
            return None
        left = LIVENESS_LAPSE_S - (time.monotonic() - self.first_round_lost_at)
        if left <= 0:
            raise StoreLostBeforeFirstAttempt(f"the coordination store was not back within {LIVENESS_LAPSE_S:.0f}s")
        return left

    def _took(self, claim: Claim, coordinator: RoundCoordinator, how: str, lost_at: float | None) -> Membership:
        """The slot's membership; says (log, metrics) which rank this spare took and how many spares are left."""
        moved = moved_slots(coordinator, self.roster.job_size)
        left = spares_left(self.roster, moved)
        after = f" {time.time() - lost_at:.1f}s after its attempt ended" if lost_at is not None else ""
        log.info("spare %s: took node rank %d (claim %d)%s%s; spares left: %d (role: worker)",
                 self.roster.peers[self.node_rank], claim.slot, claim.gen, after, f", {how}" if how else "", left)
        self.observer.node_role(NodeRole.WORKER.value, left)
        if lost_at is not None:
            self.observer.spare_took_over(time.time() - lost_at)
        return taken_over(self.roster, claim, moved)

    def _host_store(self) -> RoundCoordinator | None:
        """Node 0 and its embedded store are gone: host the store on node 0's address after this spare's turn
        (``spare_takeover_s`` for each spare before it and one more); None when it cannot (another host has it,
        or the store is etcd, which outlives node 0: then it is only reconnected). :class:`JobOver` when every other
        node's host refuses its endpoint too: the job ended (a spare that never reached the store cannot tell a
        finished job from a lost node 0 by the store alone)."""
        store, takeover_s = self.settings.store, self.settings.takeover_s
        if store.backend != "embedded":
            self.stop.wait(takeover_s, 0.1)
            self.stop.check("node 0's coordination store")
            return None
        turn = self.node_rank - self.roster.job_size + 1
        if self.stop.wait(takeover_s * turn, 0.1):
            self.stop.check("this spare's turn to host node 0's coordination store")  # raises: never host after
        host = self.roster.peers[0].rpartition(":")[0]
        if not is_local_address(host):  # node 0's address is another machine's: only a replacement node 0 hosts it
            log.info("spare %s: node 0's coordination store is gone and %s is not this host's address; waiting for "
                     "a replacement node 0", self.roster.peers[self.node_rank], host)
            return None
        # Every other process of the job: the slots' first holders and the spares (one may hold a slot now).
        others = [p for i, p in enumerate(self.roster.peers) if i not in (0, self.node_rank)]
        if others and all_gone(others, between=lambda: self.stop.check("the job's other nodes to answer")):
            log.info("spare %s: node 0's coordination store and every other node of the job are gone (their hosts "
                     "refuse connects): the job ended; nothing to host the store for", self.roster.peers[self.node_rank])
            raise JobOver("node 0's coordination store and every other node of the job are gone")
        try:
            hosted = embedded_coordinator(host, store.port, self.job, self.secret, 0, self.roster.job_size,
                                          store.rendezvous_timeout, self.stop)
        except CoordinationError as e:
            log.info("spare %s: could not host the coordination store on %s: %s", self.roster.peers[self.node_rank],
                     host, e)
            return None
        log.info("spare %s: node 0's coordination store was gone for %.1fs; hosting it on %s:%d",
                 self.roster.peers[self.node_rank], takeover_s * turn, host, store.port)
        return hosted


class JobOver(Exception):
    """The store and every node of the job are gone: it ended (finished, or every node stopped) without this
    spare, which then takes no node rank rather than host a store for nobody. The spare exits 0 only when a
    :class:`~supervisor.cluster.spares.JobEnd` record says this run finished; otherwise 1 (see :mod:`supervisor.cluster.spares`)."""


def is_local_address(host: str) -> bool:
    """Whether ``host`` names an address of this machine (binding it works): a spare may host node 0's store only
    on node 0's own address, never serve it elsewhere while its client writes into a live node 0's."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


__all__ = ["SpareRun", "SpareSettings", "RunNode", "is_local_address"]
