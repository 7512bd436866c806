"""Spare nodes: rlsup processes started with the job that hold no ranks until a node of the job is lost.

``peers`` lists N + k endpoints and ``spares: k``: node ranks 0..N-1 are the job's *slots*, the last k
processes are spares. A spare connects to the job's coordination store and watches the rounds. A slot is lost
when a round waits for its inventory (every other slot's is there, and the attempt before ended) for
``spare_takeover_s``, or sooner when its holder's own host says its rlsup is gone: the holder's replication
endpoint refuses connects (:mod:`supervisor.cluster.endpoint_probe`; a silent host is waited for). The spare then
claims the slot with the store's atomic create (``claim/<slot>/<generation>``, payload its own endpoint):
first writer wins, so no slot goes to two spares and a spare claims once. From then on the spare *is* that
node rank: it starts its replication service, joins the round as a replacement node does
(:mod:`supervisor.cluster.coordinator`: it ends nothing, the attempt already ended), fetches the slot's parts from
their holders (replicas are keyed by the slot's node rank) and launches with the slot's node rank (rank
pinning). Every other node reads the claims at each join and sends the slot's replicas to its new endpoint;
the node that held the slot before and comes back late finds a newer claim and is refused (exit 77); it may
rejoin as a spare.

A node cut off until after the job finished (its rank taken by a spare, the others done) comes back to find the
store gone with node 0. Before it waits for a store nobody will host again, and long before it would ask for a
requeue, it looks for the job's end: node 0 (whoever holds node rank 0) writes :class:`JobEnd`, the durable form of
``done``, before it sets ``done``, into the places every node can read (the checkpoint directory, which the SLURM
recipe shares, and a persistent tier on a file system, shared by design: :func:`job_end_places`), and a node whose
store is gone reads them (:class:`JobEndWatch`: in the watch of its attempt, and between a join's reconnect tries;
each read a bounded call in a child of its own, at most every :data:`JOB_END_LOOK_S`). A record signed with the
job's secret and written after this node reached the store is this run's: the node exits 0 (:class:`JobEnded`:
the job finished), never 75. A record of an earlier run of the same job (older than that) is ignored. A node back
while the store still answers reads its last word, ``done``, before it joins (:func:`check_seat`), and exits 0 too;
``done`` is held to the same rule (:func:`job_done`: signed by node 0 after this node reached the store), so a
``done`` an earlier run left in a store that outlives jobs (etcd, when node 0 could not clear the keys) ends no
node of a later run.

Exit 0 means the job succeeded, from every node (the SLURM recipe answers 0 for the job once one node exited 0): an
idle spare exits 0 only when it saw the job finish (``done``, etcd's keys cleared by node 0 after ``done``, or a
:class:`JobEnd` record of this run); one that found the store and every other node gone with no such sign (the job's
nodes gave up, or were all lost) exits 1 (:data:`supervisor.exit_codes.FAILED`), which requeues nothing by itself.

Node 0 lost with the embedded store: the store goes with it. A spare that finds the store gone for
``spare_takeover_s`` (more for each spare before it), never saw the job finish, and finds another node of the
job still there (its endpoint not refused) tries to host the store itself on node 0's address and port: only
one process can bind it, which is the arbiter; this works where the spare can bind node 0's address (one host,
or a floating address). With etcd the store outlives node 0 and slot 0 is claimed like any other.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from rlsup_format.fileio import write_durable
from rlsup_format.names import Kind, reserved_name
from supervisor.bounded_calls import BoundedCalls
from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.round_errors import CoordinationError
from supervisor.cluster.endpoint_probe import EndpointProbe
from supervisor.job_identity import JobIdentity
from supervisor.cluster.kvstore import OP_TIMEOUT_S, KVStore, StoreUnavailable, connect_store
from supervisor.membership import Membership
from supervisor.stop_request import StopRequest
from supervisor.tiers.part_stores.local import LocalStore

if TYPE_CHECKING:
    from supervisor.tiers.persistent import PersistentTier

log = logging.getLogger(__name__)

WATCH_POLL_S = 0.1
DONE_KEY = "done"  # node 0 writes it when the job succeeded: a spare then exits 0
JOB_END_LOOK_S = 2.0  # a node whose store is gone reads the places of :class:`JobEnd` at most this often
JOB_END_READ_S = 5.0  # one read of a place (a hung mount is abandoned, and not read again while it hangs)


class NodeRole(str, Enum):
    """What a node process does in the job (the ``rlsup_node_role`` metric's label)."""

    WORKER = "worker"  # holds a slot (a node rank 0..N-1)
    SPARE = "spare"  # holds none yet


class StoreLostBeforeFirstAttempt(StoreUnavailable):
    """The coordination store went away before the job's first attempt (embedded: node 0 was lost in the first
    round), which every node answers with a requeue (exit 75, :mod:`supervisor.cluster.liveness`) once it stays away
    for the lapse; a spare takes no rank then."""


class JobEnded(CoordinationError):
    """The store is gone (or says ``done``) and the job finished without this node, a spare having run its rank:
    nothing is left to join; the node exits 0, never for a requeue (see the module docstring)."""


class SlotTaken(CoordinationError):
    """This node's slot was given to a spare while it was away: it must not run its ranks."""


@dataclass(frozen=True)
class Roster:
    """The job's N + k peers: the first N are slots, the last ``spares`` are spare processes."""

    peers: tuple[str, ...]
    spares: int

    @property
    def job_size(self) -> int:
        return len(self.peers) - self.spares

    def role(self, node_rank: int) -> NodeRole:
        return NodeRole.SPARE if node_rank >= self.job_size else NodeRole.WORKER

    def membership(self, slot: int, endpoints: dict[int, str] | None = None) -> Membership:
        """Slot ``slot``'s view of the job: N peers, the moved slots at their new endpoints."""
        peers = list(self.peers[:self.job_size])
        for s, ep in (endpoints or {}).items():
            peers[s] = ep
        return Membership(tuple(peers), slot)


@dataclass(frozen=True)
class SpareSeat:
    """A slot holder's place in a job with spares: the roster, and the claim generation it holds the slot by."""

    roster: Roster
    gen: int = 0


@dataclass(frozen=True)
class Claim:
    """A spare's claim of a slot: generation ``gen`` (the original holder is generation 0) at ``endpoint``."""

    slot: int
    gen: int
    endpoint: str


def _claim_name(slot: int, gen: int) -> str:
    return f"claim/{slot}/{gen}"


def newest_claim(coordinator: RoundCoordinator, slot: int) -> Claim | None:
    """The newest claim of ``slot`` (None: its original holder has it)."""
    found: Claim | None = None
    gen = 1
    while (value := coordinator.keys.get(_claim_name(slot, gen))) is not None:
        found = Claim(slot, gen, value.payload)
        gen += 1
    return found


def moved_slots(coordinator: RoundCoordinator, job_size: int) -> dict[int, Claim]:
    """Every slot a spare took, with its newest claim."""
    return {s: c for s in range(job_size) if (c := newest_claim(coordinator, s)) is not None}


def job_done(coordinator: RoundCoordinator) -> bool:
    """Whether the store says this run of the job finished: ``done`` written (by node 0's clock) at or after this
    node reached the store, as a :class:`JobEnd` record must be; an older ``done`` is an earlier run's (the key is
    the job's, not the run's)."""
    done = coordinator.keys.get(DONE_KEY)
    return done is not None and done.time >= coordinator.started


def check_seat(coordinator: RoundCoordinator, slot: int, gen: int, job_end: "JobEndWatch | None" = None) -> None:
    """Before a join: :class:`JobEnded` when the store says this run finished (its last word, ``done``:
    :func:`job_done`) or, a store that forgot the job's keys (etcd), ``job_end``'s record does; :class:`SlotTaken`
    as :func:`check_holder`; a store out of reach is the join's to wait for."""
    if job_end is not None and (over := job_end.over()) is not None:
        raise JobEnded(over)
    try:
        if job_done(coordinator):
            raise JobEnded(f"the coordination store {coordinator.describe()} says the job finished without this node")
        check_holder(coordinator, slot, gen)
    except StoreUnavailable:
        pass


def check_holder(coordinator: RoundCoordinator, slot: int, gen: int) -> None:
    """:class:`SlotTaken` when a spare claimed ``slot`` after generation ``gen`` (this node's)."""
    claim = newest_claim(coordinator, slot)
    if claim is not None and claim.gen > gen:
        raise SlotTaken(f"node rank {slot} was given to the spare at {claim.endpoint} while this node was away "
                        f"(claim {claim.gen}); this node must not run its ranks: restart it as a spare")


def refuse_if_taken(host: str, port: int, job: JobIdentity, secret: bytes, job_size: int,
                    stop: StopRequest | None) -> None:
    """Node 0 back after a spare took its rank and hosts the store on its address: :class:`SlotTaken` (exit 77,
    it may rejoin as a spare), not a clash; nothing happens when no spare holds rank 0 (it is running twice)."""
    try:
        store = connect_store(host, port, secret, OP_TIMEOUT_S, stop)
    except StoreUnavailable:
        return
    try:
        check_holder(RoundCoordinator(store, job, secret, 0, job_size, OP_TIMEOUT_S), 0, 0)
    except StoreUnavailable:
        return  # the holder went away meanwhile: the clash stands, as before the check
    finally:
        store.close()


def try_claim(coordinator: RoundCoordinator, slot: int, endpoint: str, lost_gen: int) -> Claim | None:
    """Claim ``slot`` for ``endpoint`` from its holder of generation ``lost_gen``, the one seen lost; None when
    another spare claimed it first (the store's create: first writer wins, so a slot goes to one spare)."""
    gen = lost_gen + 1
    won = coordinator.keys.create(_claim_name(slot, gen), endpoint)
    return Claim(slot, gen, endpoint) if won.payload == endpoint else None


@dataclass
class SpareWatch:
    """A spare's wait for a lost slot (see the module docstring)."""

    coordinator: RoundCoordinator
    roster: Roster
    node_rank: int  # the spare's index in ``roster.peers``
    takeover_s: float
    stop: StopRequest
    # (attempt, slot) -> (when it was first seen missing, its holder's claim generation then)
    missing_since: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)
    lost_at: float | None = None  # wall-clock end of the attempt the claimed slot was lost in
    seen_attempt: bool = False  # an attempt was seen: its keys gone later (etcd forgets a finished job's) = done
    probe: EndpointProbe = field(default_factory=EndpointProbe)  # a missing holder whose endpoint refuses is gone
    endpoints: dict[int, str] = field(default_factory=dict)  # slot -> its holder's endpoint when it went missing
    holder_seen: dict[tuple[int, int], float] = field(default_factory=dict)  # (slot, claim gen) -> first seen

    @property
    def endpoint(self) -> str:
        return self.roster.peers[self.node_rank]

    def wait(self) -> Claim | None:
        """The slot this spare took, or None when the job finished (``done``). Raises
        :class:`~supervisor.stop_request.StopAsked` on a stop, :class:`StoreUnavailable` when the store is gone."""
        log.info("spare %s: watching the job's %d nodes for a lost one", self.endpoint, self.roster.job_size)
        while True:
            self.stop.check("a lost node to take over")
            self.coordinator.check_abort()
            if job_done(self.coordinator):
                return None
            current = self.coordinator.current_attempt()
            if current is None and self.seen_attempt:
                return None
            self.seen_attempt = self.seen_attempt or current is not None
            lost = self.lost_slot()
            if lost is not None:
                claim = try_claim(self.coordinator, lost[0], self.endpoint, lost[1])
                if claim is not None:
                    return claim
                log.info("spare %s: another spare took node rank %d", self.endpoint, lost[0])
                self.missing_since.clear()
            time.sleep(WATCH_POLL_S)

    def _may_probe(self, slot: int, gen: int, now: float) -> bool:
        """Refusals count for the slot's original holder, and for a spare's claim once it has had a whole window
        to bind its endpoint (a spare that claimed a moment ago is not listening yet: not gone)."""
        return gen == 0 or now - self.holder_seen[(slot, gen)] >= self.takeover_s

    def lost_slot(self) -> tuple[int, int] | None:
        """(slot, generation of its holder) for a slot missing from the open round while the others are in it,
        for ``takeover_s`` or until its holder's endpoint refuses connects; the generation is the one seen when
        it went missing."""
        c = self.coordinator
        current = c.current_attempt()
        if current is None or c.ended(current) is None:
            return None  # no round yet, or an attempt running: nobody is waiting for a node
        pending = current + 1
        names = [f"inv/{pending}/{s}" for s in range(self.roster.job_size)]
        present = [v is not None for v in c.keys.get_many(names)]
        if not any(present):
            return None  # nobody is in the round yet
        now = time.monotonic()
        for slot, here in enumerate(present):
            if here:
                if slot in self.endpoints:  # it came: what its endpoint did before says nothing any more
                    self.probe.forget(self.endpoints.pop(slot))
                    self.missing_since.pop((pending, slot), None)
                continue
            if (pending, slot) not in self.missing_since:
                holder = newest_claim(c, slot)
                gen = holder.gen if holder is not None else 0
                self.missing_since[(pending, slot)] = (now, gen)
                if slot in self.endpoints:
                    self.probe.forget(self.endpoints[slot])  # a new round asks afresh
                self.endpoints[slot] = holder.endpoint if holder is not None else self.roster.peers[slot]
                self.holder_seen.setdefault((slot, gen), now)
            since, gen = self.missing_since[(pending, slot)]
            if now - since >= self.takeover_s or (self._may_probe(slot, gen, now)
                                                   and self.probe.gone(self.endpoints[slot])):
                ended = c.keys.get(f"end/{current}")
                self.lost_at = ended.time if ended is not None else None
                return slot, gen
        return None


@dataclass(frozen=True)
class JobEnd:
    """Node ``node`` saw job ``job`` finish in attempt ``attempt`` at ``at`` (wall clock): the durable form of
    :data:`DONE_KEY`, for a node that comes back after the store went with the job (see the module docstring)."""

    job: str
    node: int
    attempt: int
    at: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.at))
        return f"node {self.node} recorded the job finished in attempt {self.attempt} at {when}"

    def seal(self, secret: bytes) -> bytes:
        body = json.dumps({"job": self.job, "node": self.node, "attempt": self.attempt, "at": self.at},
                          sort_keys=True)
        return json.dumps({"body": body, "mac": _mac(secret, body)}).encode()

    @classmethod
    def open(cls, raw: bytes, job: JobIdentity, secret: bytes) -> "JobEnd | None":
        """The record in ``raw`` when it is whole, signed with ``secret`` and for ``job``; None otherwise."""
        try:
            outer = json.loads(raw)
            body = outer["body"]
            if not hmac.compare_digest(str(outer["mac"]), _mac(secret, body)):
                return None
            d = json.loads(body)
            end = cls(str(d["job"]), int(d["node"]), int(d["attempt"]), float(d["at"]))
        except (ValueError, KeyError, TypeError):
            return None
        return end if end.job == job.id else None


def _mac(secret: bytes, body: str) -> str:
    return hmac.new(secret, b"rlsup-job-end\0" + body.encode(), hashlib.sha256).hexdigest()


def job_end_name(job: JobIdentity) -> str:
    """The record's file name in each place (hidden, like rlsup's other files beside the job's)."""
    return f".rlsup-job-end.{job.id}.json"


def job_end_places(checkpoint_dir: Path, persistent_root: Path | None) -> tuple[Path, ...]:
    """Where :class:`JobEnd` is written and looked for: the checkpoint directory (shared by every node in the SLURM
    recipe) and the persistent tier's directory for this job when the tier is a file system (an object store is
    not written: a node reads what its own file systems show it)."""
    return (checkpoint_dir,) if persistent_root is None else (checkpoint_dir, persistent_root)


def write_job_end(places: tuple[Path, ...], end: JobEnd, secret: bytes, job: JobIdentity) -> list[str]:
    """Write ``end`` into every place, each in a bounded call (a hung mount is left behind); the errors, in words."""
    errors = []
    data = end.seal(secret)
    for place in places:
        def write(place: Path = place) -> bool:
            place.mkdir(parents=True, exist_ok=True)
            write_durable(place / job_end_name(job), data, place / reserved_name(Kind.TMP, "job-end"))
            return True
        try:
            if not BoundedCalls(f"writing the job's end to {place}", JOB_END_READ_S, forked=True).call(write, False):
                errors.append(f"{place}: not answering")
        except OSError as e:
            errors.append(f"{place}: {e}")
    return errors


@dataclass
class JobEndLookout:
    """A node's look for :class:`JobEnd` once its store is gone (see the module docstring): a record of this run
    (written at or after ``since``, when this node reached the store, by node 0's wall clock: hosts' clocks agree
    to far better than a job's length) in any of ``places``."""

    places: tuple[Path, ...]
    job: JobIdentity
    secret: bytes
    since: float
    every_s: float = JOB_END_LOOK_S
    _next: float = 0.0
    _reads: dict[Path, BoundedCalls] = field(default_factory=dict)
    _found: JobEnd | None = None  # once found, the end stays found (no more reads)

    def look(self) -> JobEnd | None:
        """The job's end when a place records it; None when none does, or the last look was under ``every_s`` ago."""
        now = time.monotonic()
        if self._found is not None or now < self._next:
            return self._found
        self._next = now + self.every_s
        for place in self.places:
            reads = self._reads.setdefault(place, BoundedCalls(f"reading the job's end in {place}", JOB_END_READ_S,
                                                               forked=True))  # a hung mount never holds rlsup's exit
            try:
                raw = reads.call(lambda place=place: _read(place / job_end_name(self.job)), None)
            except OSError as e:
                log.info("could not read the job's end in %s: %s", place, e)
                continue
            end = JobEnd.open(raw, self.job, self.secret) if raw is not None else None
            if end is not None and end.at >= self.since:
                self._found = end
                return end
        return None


@dataclass
class JobEndWatch:
    """A slot holder's side of :class:`JobEnd` (the run loop's by composition): node 0 records the end; every node
    whose store is gone looks for it, in the watch of its attempt and between a join's reconnect tries."""

    lookout: JobEndLookout

    @classmethod
    def attach(cls, coordinator: RoundCoordinator, checkpoint_dir: Path, persistent: "PersistentTier | None",
               job: JobIdentity) -> "JobEndWatch":
        """The watch for the job of ``coordinator``; a join's wait for a lost store then reconnects in slices of
        :data:`JOB_END_LOOK_S` and ends with :class:`JobEnded` once a record says the job finished. ``persistent``:
        the node's persistent tier (or None); read and written when it is a file system."""
        tier = persistent.store if persistent is not None else None
        places = job_end_places(checkpoint_dir, tier.root if isinstance(tier, LocalStore) else None)
        watch = cls(JobEndLookout(places, job, coordinator.secret, coordinator.started))
        if coordinator.reconnect is not None:
            reconnect = coordinator.reconnect

            def reconnect_unless_ended(wait_s: float) -> KVStore:
                if (over := watch.over()) is not None:
                    raise JobEnded(f"the coordination store {coordinator.describe()} is gone and {over}")
                return reconnect(min(wait_s, JOB_END_LOOK_S))
            coordinator.reconnect = reconnect_unless_ended
        return watch

    def over(self) -> str | None:
        """The job's end in words when a record says it finished without this node; None otherwise."""
        end = self.lookout.look()
        return None if end is None else f"{end.describe()}: it finished without this node"

    def record(self, node: int, attempt: int) -> None:
        """Node 0, the job succeeded: the record, before ``done`` (the store goes with this node)."""
        lookout = self.lookout
        errors = write_job_end(lookout.places, JobEnd(lookout.job.id, node, attempt, time.time()), lookout.secret,
                               lookout.job)
        written = [str(p) for p in lookout.places if not any(e.startswith(f"{p}:") for e in errors)]
        if written:
            log.info("the job's end recorded in %s (for a node that comes back after it)", ", ".join(written))
        if errors:
            log.warning("could not record the job's end in %s", "; ".join(errors))


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(64 * 1024)
    except FileNotFoundError:
        return None


def spares_left(roster: Roster, moved: dict[int, Claim]) -> int:
    """The roster's spares not yet used: each claim generation is one spare taken."""
    return max(0, roster.spares - sum(c.gen for c in moved.values()))


def watch_for_slot(coordinator: RoundCoordinator, roster: Roster, node_rank: int, takeover_s: float,
                   stop: StopRequest, seen_attempt: bool = False,
                   carried: bool = False) -> tuple[Claim | None, float | None]:
    """:meth:`SpareWatch.wait` and when the slot was lost (the attempt's end, wall clock), the store's loss
    said in words (``StoreUnavailable`` passes through; :class:`StoreLostBeforeFirstAttempt` when no attempt was
    seen, by this watch or an earlier one: ``seen_attempt``). ``carried``: the earlier watches' attempt counts
    for this watch's "job done" rule too (a store that outlives node 0: etcd)."""
    watch = SpareWatch(coordinator, roster, node_rank, takeover_s, stop, seen_attempt=carried)
    try:
        return watch.wait(), watch.lost_at
    except StoreUnavailable as e:
        log.warning("spare %s: the coordination store %s is gone", roster.peers[node_rank], coordinator.describe())
        if not (watch.seen_attempt or seen_attempt):
            raise StoreLostBeforeFirstAttempt(str(e)) from e
        raise


def taken_over(roster: Roster, claim: Claim, moved: dict[int, Claim]) -> Membership:
    """The membership a spare runs with once it holds ``claim``'s slot."""
    endpoints = {s: c.endpoint for s, c in moved.items()}
    endpoints[claim.slot] = claim.endpoint
    return replace(roster.membership(claim.slot, endpoints))


__all__ = ["NodeRole", "Roster", "Claim", "JobEnd", "JobEndLookout", "JobEndWatch", "JobEnded", "check_seat", "job_done",
           "job_end_places", "write_job_end", "SlotTaken", "StoreLostBeforeFirstAttempt", "SpareWatch", "SpareSeat", "newest_claim", "moved_slots", "check_holder", "refuse_if_taken",
           "try_claim", "spares_left", "watch_for_slot", "taken_over", "DONE_KEY"]
