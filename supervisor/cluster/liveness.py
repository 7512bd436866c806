"""Liveness in the job's first round: a node that reached the store and then died (SIGKILL, power) before
the job's first attempt ends that round for everyone at once, naming it, instead of leaving the others to
wait out ``rendezvous_timeout`` (issue 32).

torch's c10d rendezvous keeps its participants the same way: each sends a keep-alive heartbeat (every 5 s,
``keep_alive_interval``) and one silent for ``keep_alive_max_attempt`` (3) beats is dropped from the
rendezvous (``DynamicRendezvousHandler``). rlsup needs every node and has no rendezvous to shrink, so a
lapse ends the round: the job's ``abort`` (a lost peer) and exit 75 on every node, for a requeue.

* **Beat.** From its first join into a store with no attempt yet (its first beat written by the join itself,
  before ``join/<node>``, so that a node killed before its thread wrote is still judged), each node refreshes
  ``live/<node>`` every :data:`LIVENESS_REFRESH_S` from a thread of its own, over a store connection of its own
  (:class:`LivenessBeat`): a node busy in its fetch, its pre_launch_check or its plan keeps beating; only a
  dead process (or one cut off from the store) stops. The beat ends once the first attempt is launched.
* **Lapse.** While it waits in that first round, node 0 looks at every other node's beat and every other
  node at node 0's (a constant number of keys, as for the rest of the round), once per refresh
  (:class:`LapseWatch`). A node is judged only once it is *registered*: its beat changed while watched, or it
  was written after the watcher started, less a minute (a node that beat just before the watcher came and
  died before its next beat; a beat an earlier run left in etcd is older, as for ``abort``). A registered node
  whose beat stays the same for :data:`LIVENESS_LAPSE_S` by the watcher's own clock (no clock is compared
  across hosts) is lost.

:data:`LIVENESS_LAPSE_S` is three store operation timeouts (:data:`~supervisor.cluster.kvstore.OP_TIMEOUT_S`, 15 s, as
torch's three missed 5 s beats): a beat whose write stalls (its connection given up after one timeout, 5 s),
whose reconnect to the embedded store stalls too (one try, :func:`beat_connect`: the connect and handshake bounded at
:data:`BEAT_CONNECT_S` + 1 s, 3 s; an etcd client connects within its write) and that waits two refreshes
(2 s) still writes again within 10 s, so a slow or loaded node, or a stalled connection, is never taken for a
dead one.

A registered node whose beat *vanished* counts as silent (its last beat stays the one seen): the nodes that
end a round for a lost peer clear its keys (:meth:`~supervisor.cluster.coordinator.RoundCoordinator.forget_first_round`,
so that a requeued run in a store that outlives the job, etcd, never acts on this run's ``abort`` or beats),
and a node of this run that had not yet looked still ends within the lapse. A node whose run ends otherwise
(a stop, a give-up, a clash, rlsup's own error) deletes its own beat. After the first attempt
nothing here runs: a lost node is replaced, or a spare takes over, as before.

Why exit 75 (requeue) on the nodes that are left: nothing was launched and nothing is lost, and the nodes that
exit are not the broken one. 77 would name *this* node in ``unhealthy_nodes`` and requeue without a healthy
node; naming the lost one there would exclude a host whose rlsup was merely killed; 76 or 1 would end a job a
requeue completes. A host that lost power is drained by the scheduler itself before the requeue runs.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable

from supervisor.cluster.kvstore import OP_TIMEOUT_S, EmbeddedKVStore, KVStore

log = logging.getLogger(__name__)

LIVENESS_REFRESH_S = OP_TIMEOUT_S / 5  # how often a node beats, and how often a waiting node looks
LIVENESS_LAPSE_S = 3 * OP_TIMEOUT_S  # a registered node whose beat stays the same this long is lost
BEAT_CONNECT_S = 2.0  # a beat's reconnect to the embedded store: one try, bounded at this + 1 s (see the docstring)


def beat_connect(host: str, port: int, secret: bytes) -> Callable[[], KVStore]:
    """How a beat reaches the embedded store at ``host:port``: one bounded try (the beat itself retries)."""
    return lambda: EmbeddedKVStore(host, port, secret, False, BEAT_CONNECT_S)


def live_key(node: int) -> str:
    return f"live/{node}"


@dataclass(frozen=True)
class Beat:
    """One refresh of ``live/<node>``: a counter (it changes every time) and who beats, for the messages."""

    seq: int
    host: str
    pid: int

    def to_payload(self) -> str:
        return json.dumps({"seq": self.seq, "host": self.host, "pid": self.pid})

    @classmethod
    def from_payload(cls, payload: str) -> "Beat | None":
        try:
            d = json.loads(payload)
            return cls(int(d["seq"]), str(d["host"]), int(d["pid"]))
        except (ValueError, KeyError, TypeError):
            return None


class LivenessBeat:
    """This node's beat (see the module docstring): ``write(payload)`` over ``connect()``'s store, on a
    daemon thread, until :meth:`stop`. A write that fails drops the connection; the next one reconnects."""

    def __init__(self, node_rank: int, host: str, connect: Callable[[], KVStore],
                 write: Callable[[KVStore, str], None], every_s: float = LIVENESS_REFRESH_S) -> None:
        self.node_rank, self.host, self.every_s = node_rank, host, every_s
        self._connect, self._write = connect, write
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"rlsup-liveness-{self.node_rank}", daemon=True)
            self._thread.start()

    def stop(self, wait_s: float = 0.0) -> None:
        """Ends the beat; ``wait_s``: how long to wait for a write under way (before this beat is deleted)."""
        self._stopped.set()
        if wait_s > 0 and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopped.is_set()

    def _run(self) -> None:
        store: KVStore | None = None
        seq, failing = 0, False
        while not self._stopped.is_set():
            seq += 1
            try:
                if store is None:
                    store = self._connect()
                self._write(store, Beat(seq, self.host, os.getpid()).to_payload())
                if failing:
                    log.info("node %d: liveness beat written again", self.node_rank)
                failing = False
            except Exception as e:  # noqa: BLE001 - the beat must outlive any store error: the waits report the store
                if not failing:
                    log.info("node %d: liveness beat not written (%s); retrying", self.node_rank, e)
                failing, store = True, None
            self._stopped.wait(self.every_s)


@dataclass(frozen=True)
class Lapse:
    """A registered node whose beat stayed the same for ``silent_s``."""

    node: int
    beat: Beat | None
    silent_s: float
    lapse_s: float = LIVENESS_LAPSE_S

    def describe(self) -> str:
        who = f"node {self.node}" + (f" (host {self.beat.host}, pid {self.beat.pid})" if self.beat else "")
        return (f"{who} reached the coordination store, then its liveness beat stopped for {self.silent_s:.1f}s "
                f"(lapse {self.lapse_s:g}s) before the job's first attempt: it died or lost its network")


@dataclass
class LapseWatch:
    """A waiting node's view of the beats it watches (see the module docstring). ``since``: a beat written before
    (wall clock, the writer's) belongs to an earlier run; ``lapse_s``: how long a registered beat may stay the same."""

    since: float
    lapse_s: float = LIVENESS_LAPSE_S
    seen: dict[int, tuple[str, float]] = field(default_factory=dict)  # node -> (payload, when it last changed)
    registered: set[int] = field(default_factory=set)

    def look(self, beats: dict[int, tuple[str, float] | None], now: float) -> Lapse | None:
        """``beats``: node -> (payload, the writer's signed time) or None (no beat yet); ``now``: the watcher's
        monotonic clock. The first registered node whose beat lapsed, or None."""
        for node, beat in sorted(beats.items()):
            before = self.seen.get(node)
            if beat is None:  # no beat yet; or a registered node's vanished: it stays silent since its last one
                if before is not None and node in self.registered and now - before[1] >= self.lapse_s:
                    return Lapse(node, Beat.from_payload(before[0]), now - before[1], self.lapse_s)
                continue
            payload, written = beat
            if before is None or before[0] != payload:
                if before is not None or written >= self.since:
                    self.registered.add(node)
                self.seen[node] = (payload, now)
                continue
            if node in self.registered and now - before[1] >= self.lapse_s:
                return Lapse(node, Beat.from_payload(payload), now - before[1], self.lapse_s)
        return None


__all__ = ["BEAT_CONNECT_S", "beat_connect", "LIVENESS_REFRESH_S", "LIVENESS_LAPSE_S", "Beat", "LivenessBeat", "Lapse", "LapseWatch", "live_key"]
