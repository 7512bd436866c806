"""Agreement between the node supervisors of one job, through a key-value store.

The store is the embedded one hosted by node 0's supervisor (:mod:`supervisor.cluster.kv_server`; as torchrun's c10d
rendezvous hosts its own), or etcd v3 (``coordinator_backend: etcd``), which no single node's loss stalls.
Every key lives under ``rlsup/<job>/`` and every value is signed with the job's shared secret
(HMAC-SHA256 over key, job, writer, time and payload): a value another job wrote, or one a writer
without the secret forged, is ignored and named in the log. No home-made consensus: the store's
atomic create is the only arbiter.

Every node runs attempt ``a`` (= ``RLSUP_RESTART_COUNT``, the number incidents, state.json and the CLI show)
together; the nodes agree on it in one *round* of the store, led by node 0 (or, after node 0's loss with etcd, the node
that claimed ``lead/a``: :mod:`supervisor.cluster.round_lead`; "the lead" below):

0. joining a store with no attempt yet (a new job, or a replacement node 0 hosting a fresh embedded store): every node
   proposes the next attempt it may run (``join/<node>``) and node 0 publishes ``base`` = the largest, so a job that
   lost its store keeps counting its attempts;
1. each node publishes its inventory ``inv/a/<node>`` (the checkpoint parts of this job it holds, locally or as
   replicas for others: :class:`~supervisor.tiers.holdings.NodeInventory`);
2. the lead waits for the inventories, computes the plan (the newest step whose every rank part is valid somewhere:
   in place, on a peer, or in the persistent tier; and what each node fetches) and publishes ``plan/a`` (naming its
   lead) and ``round`` = a;
3. each node fetches and publishes ``fetched/a/t/<node>`` (persistent parts that failed verification, any other
   error); the lead publishes their union ``fetched/a/t/all``, which the others read. A bad part and nothing else
   failed: the lead plans again without it (try ``t`` = 1, 2, ...: ``plan/a/t``), so the attempt falls back to an
   older step instead of ending. Then each node marks ``ready/a/<node>``, the lead publishes ``ready/a/all``, and all
   launch once they see it;
4. the first node whose attempt fails creates ``end/a`` (first writer wins); every other node sees it, stops its
   attempt, and all go to a+1. The lead ending a smaller world's attempt to grow it back marks ``resize/a`` first; a
   node whose ranks finished there claims the end for the success (``succeeded/a`` first: the two race at the job's
   last save), and then the others' ranks finish on their own and the lead records the job's end.

Only the lead reads one key per node; every other node reads a constant number of keys per attempt. A wait's poll
asks whether every key it still needs exists and, if not, whether the attempt ended (one etcd transaction, one
embedded-store request); values move once all are there.

Values are signed, not trusted to parse: a record that does not parse (a node of another version, a broken one:
:class:`~supervisor.tiers.holdings.RecordError`, naming node and field) offers nothing (an inventory), counts as a
failed fetch (a fetch result) or ends the attempt for all (a plan); no node crashes on what another wrote.

A node that joins while attempt ``c`` is open (planned or based, and not ended) is a replacement for a
lost node: it ends attempt ``c`` (its predecessor's ranks are gone anyway) and joins ``c+1``. ``abort``
makes every node give up; every wait looks at it (about twice a second), so a node that refuses to start
(a directory or port another job holds: ``abort`` then says it is a clash, and the others exit 2 as it
does) ends its job's other nodes at once instead of leaving them to wait out ``rendezvous_timeout``. The
embedded store also carries ``rlsup/host``, the job it is hosted for: a node of another job that reaches
it (same hosts, same default port) refuses to start and names both jobs.

Every wait here (the store's connect and reconnect, the joins, the round's waits) also asks the run's
:class:`~supervisor.stop_request.StopRequest` at each poll: SIGTERM or the preemption signal ends it at
once with :class:`~supervisor.stop_request.StopAsked`, never after the timeout. In the job's first round a
node that reached the store and then died ends it for all within seconds (:mod:`supervisor.cluster.liveness`).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Callable, Iterable, NoReturn

from supervisor.tiers.holdings import FetchResult, NodeInventory, RecordError, RoundPlan
from supervisor.job_identity import JobIdentity
from supervisor.lifecycle import EndReason
from supervisor.cluster.round_errors import CoordinationError, NodesMissing, PeerLost, RoundEnded, aborted
from supervisor.cluster.kvstore import (CONNECT_SLICE_S, OP_TIMEOUT_S, KVStore, StoreUnavailable)
from supervisor.cluster.liveness import LIVENESS_REFRESH_S, Beat, LapseWatch, LivenessBeat, live_key
from supervisor.cluster.store_host import refuse_other_job
from supervisor.cluster.signed_keys import AbortKind, AbortNotice, Signed, SignedKeys
from supervisor.stop_request import StopRequest

log = logging.getLogger(__name__)


WAIT_POLL_MIN_S = 0.002  # a wait polls fast at first (agreement is quick when every node is there) ...
WAIT_POLL_MAX_S = 0.05  # ... and backs off to this
ABORT_MAX_AGE_S = 60.0  # an abort written this long before this node started belongs to an earlier run
ABORT_POLL_S = 0.5  # how often a wait looks at ``abort`` (one more read; the attempt's end is read every poll)
PARTIAL_LOOK_S = 0.2  # a wait that may end short (``enough``) reads what came this often, per 64 keys (one check each)
WAIT_TELL_S = 3.0  # a wait that lasts this long says what it waits for (once), for whoever reads the log
REACH_AGAIN_S = OP_TIMEOUT_S  # the run loop's watch of the attempt's end tries a lost store again this often


class RoundCoordinator:
    """One node's handle on the job's attempts (see the module docstring).

    ``reconnect``: how to reach the store again after it was lost (the embedded store, when node 0's
    supervisor died and a replacement hosts a new one); None for a store that does not go away.
    ``stop``: the run's stop request, asked at every poll of every wait (None: waits end only as below).
    ``beat_store``: a store connection of its own for this node's liveness beat in the job's first round
    (:mod:`supervisor.cluster.liveness`); None: no beat (a node that only reads the store: a spare, a notice)."""

    def __init__(self, store: KVStore, job: JobIdentity, secret: bytes, node_rank: int, num_nodes: int,
                 timeout_s: float, reconnect: Callable[[float], KVStore] | None = None,
                 stop: StopRequest | None = None, beat_store: Callable[[], KVStore] | None = None) -> None:
        self.job, self.secret = job, secret
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.timeout_s = timeout_s
        self.reconnect = reconnect
        self.stop = stop
        self.started = time.time()
        self.keys = SignedKeys(store, job, secret, node_rank)
        # The job's first round (supervisor.cluster.liveness): None until a join tells, True from a join into a store
        # with no attempt until the first attempt launches, False once the job has had one.
        self.first_round: bool | None = None
        self._proposed = False  # this join() call proposed in a fresh store (its own retries join that attempt)
        self.lapses = LapseWatch(self.started - ABORT_MAX_AGE_S)  # a beat older belongs to an earlier run, as an abort
        self.refresh_s = LIVENESS_REFRESH_S
        self.beat: LivenessBeat | None = None
        self._beat_store = beat_store
        self._store_lost_at: float | None = None  # when the store was lost in the first round (its bound)
        self._reach_again_at = 0.0  # reach_again's next try
        self._running: dict[int, tuple[int, ...] | None] = {}  # attempt -> the nodes its plan runs (None: all)
        self._lead: dict[int, int] = {}  # attempt -> the node that planned it (its plan's word; 0 until read)

    def check_stop(self, waiting_for: str) -> None:
        """:class:`~supervisor.stop_request.StopAsked` when rlsup was asked to stop (see the module docstring)."""
        if self.stop is not None:
            self.stop.check(waiting_for)

    @property
    def store(self) -> KVStore:
        return self.keys.store

    def describe(self) -> str:
        return self.store.describe()

    def check_host(self) -> None:
        """Refuse an embedded store hosted for another job (:func:`supervisor.cluster.store_host.refuse_other_job`)."""
        refuse_other_job(self.keys, self.job, min(10.0, self.timeout_s), self.check_stop)

    # ------------------------------------------------------------ attempts

    def join(self, min_attempt: int = 0) -> int:
        """The attempt this node takes part in next (see the module docstring); ``min_attempt`` is the attempt
        this node would run next by its own count (used only when the store has no attempt yet)."""
        deadline = time.monotonic() + self.timeout_s
        told, self._proposed = False, False  # one line per outage, not one per reconnect try
        while True:  # each wait inside asks the stop request (the reconnect's too)
            try:
                return self._join(min_attempt)
            except StoreUnavailable as e:
                if self.reconnect is None:
                    raise CoordinationError(f"the coordination store is unreachable: {e}") from e
                left = deadline - time.monotonic()
                if self.first_round:  # node 0 (and its store) lost before the first attempt: not for long
                    lost_at = self._store_lost_at = self._store_lost_at or time.monotonic()
                    if (lapse := lost_at + self.lapses.lapse_s - time.monotonic()) <= 0:
                        raise self._lost(f"node 0 hosted the coordination store {self.describe()}, and it has been "
                                         f"gone for {self.lapses.lapse_s:g}s before the job's first attempt: "
                                         f"node 0 died or lost its network ({e})") from e
                    left = min(left, lapse)
                if left <= 0:
                    raise CoordinationError(f"the coordination store {self.describe()} stayed unreachable for "
                                            f"{self.timeout_s:.0f}s (rendezvous_timeout): {e}") from e
                if not told:
                    told = True
                    log.warning("node %d: the coordination store %s is gone; waiting up to %.0fs for node 0 (or its "
                                "replacement) to host it again", self.node_rank, self.describe(), left)
                try:
                    self.keys.store = self.reconnect(left)
                    self.check_host()
                    self._store_lost_at = None
                except StoreUnavailable:
                    continue

    def _join(self, min_attempt: int) -> int:
        self._check_abort()
        current = self.current_attempt()
        if current is None:
            return self._join_fresh(min_attempt)
        if self._proposed and self.ended(current) is None:  # this join() proposed, then a store call failed: retried
            return current
        if not self.first_round:  # a store with attempts: a replacement node (or a later join) has no first round
            self.end_first_round()
        ending = self.ending(current)
        if ending is None or ending[1] is EndReason.SUCCESS:
            # the job goes on with fewer nodes (grow at its next save, not now), or finished so: wait for node 0's word
            if self.runs_without_me(current):
                return current
            if ending is None:
                self.end(current, f"node {self.node_rank} rejoined")
        after = current + 1
        while self.ended(after) is not None:  # ended before its plan (a stop in its round, a lead gone): nobody runs it
            after += 1
        return after

    def current_attempt(self) -> int | None:
        """The newest attempt this store knows (planned, or the first one opened); None until the nodes' first
        join is through."""
        names = ["round", "base"]  # the planned attempt, the first one a fresh store opened
        values = [_attempt_number(n, v) for n, v in zip(names, self.keys.get_many(names)) if v is not None]
        return max(values) if values else None

    def check_abort(self) -> None:
        """:meth:`_check_abort`, for a process that watches the job without joining it (a spare)."""
        self._check_abort()

    def _join_fresh(self, min_attempt: int) -> int:
        """No attempt in this store yet: every node proposes; node 0 publishes the largest as ``base``. The
        job's first round begins (unless the job had an attempt in a store that went): this node beats."""
        if self.first_round is None:
            self.first_round = True
        if self.first_round:
            self._start_beat()  # its first beat written here, before join/<node>: every node that joined has beaten
        self._proposed = True
        self.keys.set(f"join/{self.node_rank}", str(min_attempt))
        if self.node_rank == 0:
            names = [f"join/{n}" for n in range(self.num_nodes)]
            self._wait(names, "every node to join")
            base = max(_attempt_number(n, v) for n, v in zip(names, self.keys.get_many(names)) if v is not None)
            return _attempt_number("base", self.keys.create("base", str(base)))
        self._wait(["base"], "node 0 to open the first attempt")
        got = self.keys.get("base")
        assert got is not None
        return _attempt_number("base", got)

    def _check_abort(self) -> None:
        """:class:`JobClash` when a node of this job refused to start for a clash, :class:`PeerLost` when one was
        lost before the first attempt, :class:`CoordinationError` when one gave up; an abort older than this
        node's start (by :data:`ABORT_MAX_AGE_S`) is an earlier run's."""
        abort = self.keys.get("abort")
        if abort is None or abort.time < self.started - ABORT_MAX_AGE_S:
            return
        raise aborted(AbortNotice.from_payload(abort.payload))

    # ------------------------------------------------------------ the first round's liveness

    def _start_beat(self) -> None:
        """This node's liveness beat (:mod:`supervisor.cluster.liveness`), until the first attempt launches; it also
        ends when this object is collected (a test's coordinator, a run that raised)."""
        if self._beat_store is None or self.beat is not None:
            return
        from supervisor.membership import node_name
        name = live_key(self.node_rank)
        keys = SignedKeys(self.store, self.job, self.secret, self.node_rank)  # sealing only: writes go to the beat's store

        def write(store: KVStore, payload: str) -> None:
            store.set(keys.key(name), keys.seal(keys.key(name), payload))

        write(self.store, Beat(0, node_name(), os.getpid()).to_payload())  # the join's own (liveness: "Beat")
        self.beat = LivenessBeat(self.node_rank, node_name(), self._beat_store, write, self.refresh_s)
        weakref.finalize(self, self.beat.stop)
        self.beat.start()

    def end_first_round(self, clear: bool = False) -> None:
        """The job's first attempt launched (or this node joined a job that had one): no beat, no lapse rule.
        ``clear``: this node's run ends inside that round (a stop, a give-up, an error): its beat is deleted,
        so that a requeued run in a store that outlives it (etcd) never counts it."""
        was, self.first_round = self.first_round, False
        if self.beat is not None:
            self.beat.stop(wait_s=OP_TIMEOUT_S if clear else 0.0)  # a write under way lands before the delete
        if clear and was:
            self.store.delete([self.keys.key(live_key(self.node_rank))])

    def forget_first_round(self) -> None:
        """After :class:`PeerLost` (and a linger, so that every node saw ``abort``): the job's keys go, ``abort``
        and the beats with them, so that the requeued run in a store that outlives this one (etcd) starts a
        fresh first round. Every node that ends so does it (node 0 may be the lost one)."""
        self.end_first_round()
        names = ["abort", "base", "round"] + [f"{k}/{n}" for n in range(self.num_nodes) for k in ("live", "join")]
        self.store.delete([self.keys.key(n) for n in names])  # a store without prefix deletion (the embedded one)
        self.store.delete_prefix(self.keys.prefix)  # etcd: every key of the round (inventories, plans) too

    def _look_at_beats(self) -> None:
        """In the first round: :class:`PeerLost` (and the job's ``abort``) when a registered node's beat lapsed;
        node 0 watches every other node, the others node 0."""
        nodes = range(1, self.num_nodes) if self.node_rank == 0 else [0]
        values = self.keys.get_many([live_key(n) for n in nodes])
        lapse = self.lapses.look({n: (v.payload, v.time) if v is not None else None for n, v in zip(nodes, values)},
                                 time.monotonic())
        if lapse is not None:
            raise self._lost(lapse.describe())

    def _lost(self, why: str) -> CoordinationError:
        """The job's ``abort`` for a node lost before the first attempt (first writer wins): the exception to
        raise, from the notice that won (maybe another node's, maybe a clash)."""
        log.error("node %d: %s; ending the job's first round for every node", self.node_rank, why)
        try:
            won = self.keys.create("abort", AbortNotice(f"node {self.node_rank}: {why}", AbortKind.PEER_LOST).to_payload())
            return aborted(AbortNotice.from_payload(won.payload))
        except StoreUnavailable:
            return PeerLost(f"the job's first round ended: {why}")

    def publish_inventory(self, attempt: int, inventory: NodeInventory) -> None:
        self.keys.set(f"inv/{attempt}/{self.node_rank}", inventory.to_json())

    def inventories(self, attempt: int) -> list[NodeInventory]:
        """Every node's inventory, in node order. One that does not parse (a node of another rlsup version,
        or a damaged store) ends the attempt for all, naming the node and field: planning without that
        node's parts could start the job afresh over checkpoints it still holds."""
        values = self._wait([f"inv/{attempt}/{n}" for n in range(self.num_nodes)], f"inventories of attempt {attempt}",
                            attempt, nodes_lost=True)
        return [self._inventory(attempt, node, value) for node, value in enumerate(values)]

    def _inventory(self, attempt: int, node: int, value: str) -> NodeInventory:
        try:
            return NodeInventory.from_json(value, node)
        except RecordError as e:
            why = f"node {self.node_rank}: {e} (a node of another rlsup version, or a damaged store?)"
            raise RoundEnded(f"attempt {attempt} ended: {self.end(attempt, why)}") from e

    def present_inventories(self, attempt: int, after_s: float, floor: int,
                            gone: Callable[[int], bool] = lambda node: False) -> dict[int, NodeInventory]:
        """Every node's inventory, or, when some are still missing ``after_s`` seconds into the wait (or once ``gone``
        says so of each: its endpoint refuses), those that came if they are ``floor`` or more (issue 43: a job that may
        go on with fewer nodes); waits on as :meth:`inventories` otherwise. Node -> inventory."""
        names = [f"inv/{attempt}/{n}" for n in range(self.num_nodes)]
        all_gone = lambda missing: all([gone(int(name.rsplit("/", 1)[1])) for name in missing])  # noqa: E731 - each probe
        values = self._wait(names, f"inventories of attempt {attempt}", attempt, enough=(after_s, floor, all_gone),
                            nodes_lost=True)
        return {node: self._inventory(attempt, node, value) for node, value in enumerate(values) if value is not None}

    def runs_without_me(self, attempt: int) -> bool:
        """Whether attempt ``attempt``'s plan leaves this node out: the job went on with fewer nodes, and this
        node (back, or a replacement) waits for the job's next save to grow it back instead of ending the
        attempt."""
        value = self.keys.get(self._plan_key(attempt, 0))
        if value is None:
            return False
        try:
            return not RoundPlan.from_json(value.payload, 0).runs(self.node_rank)
        except RecordError:
            return False

    @staticmethod
    def _plan_key(attempt: int, plan_try: int) -> str:
        return f"plan/{attempt}" if plan_try == 0 else f"plan/{attempt}/{plan_try}"

    def publish_plan(self, plan: RoundPlan, plan_try: int = 0) -> None:
        """Try 0 is the attempt's plan (``round`` = a marks it planned); later tries replace a plan whose
        persistent parts failed verification."""
        self.keys.set(self._plan_key(plan.attempt, plan_try), plan.to_json())
        if plan_try == 0:
            self.keys.set("round", str(plan.attempt))

    def plan(self, attempt: int, plan_try: int = 0) -> RoundPlan:
        """Node 0's plan; one that does not parse ends the attempt for all (:class:`RoundEnded`)."""
        key = self._plan_key(attempt, plan_try)
        (value,) = self._wait([key], f"the plan of attempt {attempt}" + (f" (try {plan_try})" if plan_try else ""),
                              attempt, nodes_lost=True)
        try:
            plan = RoundPlan.from_json(value, 0)
        except RecordError as e:
            raise RoundEnded(f"attempt {attempt} ended: {self.end(attempt, f'node {self.node_rank}: {e}')}") from e
        if plan.attempt != attempt:
            why = f"node {self.node_rank}: {key} plans attempt {plan.attempt}"
            raise RoundEnded(f"attempt {attempt} ended: {self.end(attempt, why)}")
        self._running[attempt] = plan.nodes
        self._lead[attempt] = plan.lead
        return plan

    def lead_of(self, attempt: int) -> int:
        """The node that planned ``attempt`` (and gathers its round): node 0 unless a node took the lead from a lost
        node 0 (:meth:`claim_lead`), as the attempt's plan says once read."""
        return self._lead.get(attempt, 0)

    def leads(self, attempt: int) -> bool:
        return self.lead_of(attempt) == self.node_rank

    def nodes_of(self, attempt: int) -> list[int]:
        """The nodes that run ``attempt`` by its plan (every node of the job until the plan was read)."""
        return list(self._running.get(attempt) or range(self.num_nodes))

    def claim_lead(self, attempt: int, claim: bool = True) -> int | None:
        """This node asks to plan ``attempt`` (``lead/a``: the store's atomic create decides); the node that leads.
        ``claim`` False: only who claimed it (None: nobody yet)."""
        name = f"lead/{attempt}"
        won = self.keys.create(name, str(self.node_rank)) if claim else self.keys.get(name)
        if won is not None:
            self._lead[attempt] = _attempt_number(name, won)
        return None if won is None else self._lead[attempt]

    def plan_or_absent(self, attempt: int, node: int | None, after_s: float, gone: Callable[[], bool],
                       looks_from_s: float = 0.0) -> bool:
        """Wait until ``attempt``'s plan (or ``node``'s inventory) is in the store: True when none came within
        ``after_s`` (or once ``gone``, asked from ``looks_from_s`` into the wait, says the node expected to plan is
        gone): the node that plans is missing. The attempt's end, a stop or an abort ends it as any round's wait."""
        names = [self._plan_key(attempt, 0)] + ([f"inv/{attempt}/{node}"] if node is not None else [])
        what = f"the plan of attempt {attempt}" + (f" or node {node}'s inventory" if node is not None else "")
        return all(v is None for v in self._wait(names, what, attempt, nodes_lost=True, looks_from_s=looks_from_s,
                   enough=(after_s, 0, lambda missing: len(missing) < len(names) or gone())))

    def publish_fetch_result(self, attempt: int, plan_try: int, result: FetchResult) -> None:
        self.keys.set(f"fetched/{attempt}/{plan_try}/{self.node_rank}", result.to_json())

    def fetch_results(self, attempt: int, plan_try: int) -> list[FetchResult]:
        """The results of try ``plan_try``, the same answer on every node: on the attempt's lead every node's (it
        waits for all, then publishes their union ``fetched/a/t/all``); elsewhere that union, one key.
        A result that does not parse is a failed fetch (the attempt ends, as for any fetch error)."""
        prefix, lead = f"fetched/{attempt}/{plan_try}", self.lead_of(attempt)
        if lead != self.node_rank:
            (value,) = self._wait([f"{prefix}/all"], f"node {lead}'s summary of every node's fetch in attempt {attempt}",
                                  attempt)
            return [_fetch_result(value, lead)]  # the lead wrote the union
        nodes = self.nodes_of(attempt)
        results = [_fetch_result(v, n) for n, v in
                   zip(nodes, self._wait_all(prefix, f"every node's fetch in attempt {attempt}", attempt, nodes))]
        union = FetchResult(sorted({b for r in results for b in r.bad}),
                            "; ".join(f"node {n}: {r.error}" for n, r in zip(nodes, results) if r.error))
        self.keys.set(f"{prefix}/all", union.to_json())
        return results

    def mark_ready(self, attempt: int) -> None:
        self.keys.set(f"ready/{attempt}/{self.node_rank}", "1")

    def wait_all_ready(self, attempt: int) -> None:
        """Until every node is ready: the attempt's lead waits for every ``ready/a/<node>`` and publishes
        ``ready/a/all``, which the other nodes wait for."""
        if not self.leads(attempt):
            self._wait([f"ready/{attempt}/all"], f"node {self.lead_of(attempt)} to see all nodes ready for attempt "
                       f"{attempt}", attempt)
        else:
            self._wait_all(f"ready/{attempt}", f"all nodes ready for attempt {attempt}", attempt, self.nodes_of(attempt))
            self.keys.set(f"ready/{attempt}/all", "1")
        self.end_first_round()  # every node is ready: the job's first round, if this was it, is over

    def end(self, attempt: int, reason: str) -> str:
        """End attempt ``attempt`` for everyone; returns the reason that won (maybe another node's)."""
        return self.keys.create(f"end/{attempt}", reason).payload

    def ended(self, attempt: int) -> str | None:
        """Non-blocking: why attempt ``attempt`` ended, or None while it runs."""
        value = self.keys.get(f"end/{attempt}")
        return None if value is None else value.payload

    def end_to_resize(self, attempt: int, reason: str) -> str:
        """Node 0 ends ``attempt`` to grow the job back, marked first so every node tells it from a failure (:meth:`ending`)."""
        return self._end_marked("resize", attempt, reason)

    def end_succeeded(self, attempt: int, reason: str) -> str:
        """This node's ranks all exited 0 in a smaller world: the success claims the attempt's one end, against a grow
        back the lead started at the same save (the job's last). Returns the words that won (:meth:`ending`)."""
        return self._end_marked("succeeded", attempt, reason)

    def _end_marked(self, mark: str, attempt: int, reason: str) -> str:
        marked = self.keys.create(f"{mark}/{attempt}", reason).payload  # a retry keeps the first words: ending()
        return self.end(attempt, marked)

    def ending(self, attempt: int) -> tuple[str, EndReason] | None:
        """Non-blocking: why ``attempt`` ended, ``resized`` if by :meth:`end_to_resize`, ``success`` if by
        :meth:`end_succeeded`, else ``peer_failure``; or None while it runs."""
        why = self.ended(attempt)
        if why is None:
            return None
        marks = self.keys.get_many([f"resize/{attempt}", f"succeeded/{attempt}"])
        kinds = (EndReason.RESIZED, EndReason.SUCCESS)
        return why, next((k for k, m in zip(kinds, marks) if m is not None and m.payload == why), EndReason.PEER_FAILURE)

    def reach_again(self) -> bool:
        """For the run loop's watch of a running attempt, after a store call failed: a store connection that
        stalled (the operation timeout gives it up for good) is replaced, so the watch sees another node's end
        again once the store answers instead of going blind until the next join. One bounded try
        (:data:`CONNECT_SLICE_S`, the stop asked) every :data:`REACH_AGAIN_S`; :class:`StoreUnavailable` while
        the store is out of reach (the job's own end decides meanwhile). A store that does not go away (etcd:
        every call fails over by itself) has nothing to replace: False, and the caller does not ask it again."""
        if self.reconnect is None:
            return False
        if time.monotonic() < self._reach_again_at:
            raise StoreUnavailable(f"coordination store {self.describe()}: tried again less than "
                                   f"{REACH_AGAIN_S:.0f}s ago")
        self._reach_again_at = time.monotonic() + REACH_AGAIN_S
        lost, self.keys.store = self.keys.store, self.reconnect(CONNECT_SLICE_S)
        try:
            self.check_host()
        except CoordinationError as e:  # another job's store on node 0's port now: not ours to watch
            self.keys.store = lost
            raise StoreUnavailable(str(e)) from e
        return True

    def abort(self, reason: str, clash: bool = False) -> None:
        """Every node of the job gives up (first writer's reason wins); ``clash``: this node refused to start
        because another job holds what it needs (its peers exit 2 too)."""
        self.keys.create("abort", AbortNotice(reason, AbortKind.CLASH if clash else AbortKind.GAVE_UP).to_payload())

    def finish(self, attempt: int) -> None:
        """The job ended for good in ``attempt``: a store that outlives it (etcd) forgets its keys (the lead only)."""
        if self.leads(attempt):
            self.store.delete_prefix(self.keys.prefix)

    # ------------------------------------------------------------ waiting

    def _wait_all(self, prefix: str, what: str, attempt: int | None,
                  nodes: Iterable[int] | None = None) -> list[str]:
        """``prefix/<node>`` of every node (``nodes``: of those that run the attempt, when it runs on fewer)."""
        nodes = range(self.num_nodes) if nodes is None else nodes
        return [v for v in self._wait([f"{prefix}/{n}" for n in nodes], what, attempt) if v is not None]

    def _wait(self, names: list[str], what: str, attempt: int | None = None,
              enough: tuple[float, int, Callable[[list[str]], bool]] | None = None, nodes_lost: bool = False,
              looks_from_s: float = 0.0) -> list:
        """Poll until every key holds a signed value; their payloads. Inside attempt ``attempt``, its end
        stops the wait with :class:`RoundEnded`: a node that died there never writes its keys, and its
        replacement ends the attempt on rejoin, so waiting out the timeout would only lose the job. A
        store lost meanwhile ends the attempt too (node 0 is gone; the next join waits for it). A stop asked
        ends any wait at its next poll (:meth:`check_stop`), and so does the job's ``abort`` (looked at every
        :data:`ABORT_POLL_S`: :class:`JobClash` when a node refused to start for a clash).

        A poll is one look (:meth:`KVStore.poll`: one etcd transaction or one embedded-store request) whatever
        the number of keys: whether every key still missing exists, and if not, whether the attempt ended.
        Values move and are verified once they all exist; a verified value is kept, so only a key that
        failed verification is read again. Between polls the store's :meth:`KVStore.wait_for_change` waits:
        etcd watches the keys and the end, and the next poll is skipped while nothing was written; the
        abort is first looked at :data:`ABORT_POLL_S` into the wait (the join looked just before).

        ``enough`` = (seconds, count, gone): after that many seconds (or once ``gone`` says the keys missing never
        come), return once ``count`` keys are there, None for the others (a round that may go on without lost nodes);
        what came is read from ``looks_from_s`` into the wait (before, a wait that ends in time costs no reads). ``nodes_lost``: a timeout means nodes did not come to the round (the inventories, the plan): after the job's
        first attempt, :class:`NodesMissing`."""
        started = time.monotonic()
        deadline = started + self.timeout_s
        poll = WAIT_POLL_MIN_S
        end_name = f"end/{attempt}" if attempt is not None else None
        got: dict[str, Signed] = {}
        next_abort_look, tell_at = time.monotonic() + ABORT_POLL_S, time.monotonic() + WAIT_TELL_S
        next_beat_look, next_partial_look = time.monotonic(), started + looks_from_s
        changed = True  # whether to poll: the store may know that nothing we wait for was written since the last
        while True:
            self.check_stop(what)
            if tell_at is not None and time.monotonic() >= tell_at:
                tell_at = None
                log.info("node %d: waiting for %s (up to %.0fs, rendezvous_timeout)", self.node_rank, what,
                         self.timeout_s)
            if time.monotonic() >= next_abort_look:  # a node that refused to start, or gave up
                next_abort_look = time.monotonic() + ABORT_POLL_S
                try:
                    self._check_abort()
                except StoreUnavailable:
                    pass  # the poll below says what an unreachable store means here
            pending = [n for n in names if n not in got]
            settled = enough is not None and time.monotonic() >= started + enough[0]  # look again, even unchanged
            partial = enough is not None and (settled or time.monotonic() >= next_partial_look)  # paced: read below
            if changed or partial or time.monotonic() > deadline:
                try:
                    values, ended = self.keys.poll(pending, end_name)
                    read_end = values is not None  # the poll moved every value, not the end
                    if values is None and partial and ended is None:  # some are missing: read those that came
                        next_partial_look = time.monotonic() + PARTIAL_LOOK_S * (1 + len(pending) // 64)
                        values = self.keys.get_many(pending)
                    if values is not None:
                        got.update((n, v) for n, v in zip(pending, values) if v is not None)
                        if len(got) == len(names) or (enough is not None and len(got) >= enough[1] and (
                                settled or enough[2]([n for n in names if n not in got]))):
                            return [got[n].payload if n in got else None for n in names]
                        if read_end:  # all there, and a value did not verify
                            ended = self.keys.get(end_name) if end_name else None
                    if ended is None and time.monotonic() > deadline:
                        pending = [n for n, v in zip(pending, self.keys.get_many(pending)) if v is None]
                except StoreUnavailable as e:
                    self._unreachable_in_wait(e, attempt, what)
                if ended is not None:
                    raise RoundEnded(f"attempt {attempt} ended while waiting for {what}: {ended.payload}")
                if time.monotonic() > deadline and pending:
                    missing = [self.keys.key(n) for n in pending]
                    kind = NodesMissing if nodes_lost and self.first_round is False else CoordinationError
                    raise kind(f"timed out after {self.timeout_s:.0f}s waiting for {what}; missing {missing}")
            if self.first_round and time.monotonic() >= next_beat_look:  # after the poll: keys that came win
                next_beat_look = time.monotonic() + self.refresh_s
                try:
                    self._look_at_beats()
                except StoreUnavailable:
                    pass  # the next poll says what an unreachable store means here
            watched = [self.keys.key(n) for n in pending + ([end_name] if end_name else [])]
            changed = self.store.wait_for_change(watched, poll)  # etcd: a watch; the embedded store: a held wait
            poll = min(poll * 2, WAIT_POLL_MAX_S)

    def _unreachable_in_wait(self, e: StoreUnavailable, attempt: int | None, what: str) -> NoReturn:
        """What a store lost in :meth:`_wait` means: the join's own wait reconnects (within its deadline); inside an
        attempt, the attempt is over (the next join waits for the store); a store nothing replaces, an error."""
        if self.first_round and self.reconnect is not None:  # the join waits for it, not for long
            self._store_lost_at = self._store_lost_at or time.monotonic()
        if self.reconnect is not None and attempt is None:
            raise e  # a join's wait (a fresh store's base)
        if self.reconnect is not None:
            raise RoundEnded(f"attempt {attempt} ended while waiting for {what}: {e}") from e
        raise CoordinationError(f"the coordination store is unreachable while waiting for {what}: {e}") from e


def _attempt_number(name: str, value: Signed) -> int:
    """An attempt number a node stored under ``name`` (``join/<node>``, ``base``, ``round``)."""
    try:
        number = int(value.payload)
    except ValueError:
        number = -1
    if number < 0:
        raise CoordinationError(f"node {value.node} stored {name} = {value.payload[:40]!r}, not an attempt number "
                                "(a node of another rlsup version in this job?)")
    return number


def _fetch_result(value: str, node: int | None) -> FetchResult:
    """``node``'s fetch result; one that does not parse counts as a failed fetch."""
    try:
        return FetchResult.from_json(value, node)
    except RecordError as e:
        return FetchResult(error=str(e))


__all__ = ["RoundCoordinator"]
