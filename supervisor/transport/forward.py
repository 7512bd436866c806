"""Chain replication: a hop that stored a file sends it on to the next hop.

A sender that wants a file on several peers pushes it once, to the first of them, naming the others
in the request's query: ``PUT /v1/files/<ns>/<rel>?forward=host:port,host:port``. The query is part
of the signed path (:mod:`supervisor.transport.auth`), so nobody on the wire can redirect a chain.
Each hop checks the list before the body is read (:func:`parse_forward`: only its allow-listed peers,
never itself, no endpoint twice, at most :data:`MAX_HOPS`), stores and verifies the file, answers
(``forwarded``: every endpoint downstream ``"queued"``), and its :class:`Forwarder` then pushes the
stored file to the next hop in the background (``sendfile`` from the page cache; same size and
declared xxh3, re-signed, the rest of the list in the query). The next hop verifies the bytes
itself, so a hop never vouches for another's copy.

Why store, answer, then forward (and not a tee, or an answer after the whole chain): the sender's
cost is one push whatever the chain's length, in bytes and in time, even where the hops share a
disk or cores; forwarding from the page cache costs a hop no copy through Python. Whether the copy
arrived is read from the far hop's index, as for any replica (the sender copies directly where it
did not). A downstream failure never fails the local copy.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection

log = logging.getLogger("rlsup.transport.forward")

MAX_HOPS = 8
OK = "ok"
_ENDPOINT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252}):[0-9]{1,5}$")


#: How much lower than the hop's own work its forwarding threads run (Linux nice is per thread): as low
#: as Linux goes (19 above a daemon at 0). Nice ranks threads against others of the same cgroup (the
#: daemon's own unit under systemd), so what the forward yields to is the hop's receives, which a sender
#: waits on, and its own pushes; on idle cores it runs at full speed. The price: where cores are short,
#: the far copy lands later (on one 2-core VM: a 2-peer push cost the sender 1.03x one push at 19, 1.2-2.1x
#: at 10; both copies were in place at 0.79x two rsync daemons' rate at 19, 1.08x at 10: BENCHMARKS.md). A
#: chain too slow for its arrival deadline falls back to a direct copy (supervisor/tiers/part_stores/peer.py).
FORWARD_NICENESS = 19


def lower_thread_priority(niceness: int = FORWARD_NICENESS) -> None:
    """Run the calling thread ``niceness`` steps nicer: a hop's forward is background work and must
    not slow the hop's receives (a sender waits on those) or its own pushes. Linux only
    (elsewhere ``setpriority`` on a thread id would name a process); a refusal leaves it as it was."""
    if sys.platform != "linux":
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
    except OSError:  # pragma: no cover - a sandbox without setpriority: forward at the same priority
        pass


class ForwardRefused(ValueError):
    """The request's forward list may not be followed; the message names the endpoint."""


def parse_forward(query: str, allowed: Collection[str], own: Collection[str]) -> tuple[str, ...]:
    """The endpoints a PUT's query asks this server to forward to, in order ((): none). ForwardRefused
    for anything but ``forward=<endpoint>[,<endpoint>...]`` of allow-listed peers, without this server
    (a loop), without repeats, at most :data:`MAX_HOPS` long."""
    if not query:
        return ()
    key, sep, value = query.partition("=")
    if key != "forward" or not sep or "&" in value or "=" in value:
        raise ForwardRefused(f"malformed query {query[:200]!r}: want forward=host:port[,host:port...]")
    hops = tuple(value.split(","))
    if len(hops) > MAX_HOPS:
        raise ForwardRefused(f"forward list has {len(hops)} endpoints, at most {MAX_HOPS} are followed")
    for i, ep in enumerate(hops):
        if not _ENDPOINT_RE.match(ep):
            raise ForwardRefused(f"malformed forward endpoint {ep[:200]!r}: want host:port")
        if ep in own:
            raise ForwardRefused(f"forward endpoint {ep} is this server: a loop")
        if ep in hops[:i]:
            raise ForwardRefused(f"forward endpoint {ep} appears twice: a loop")
        if ep not in allowed:
            raise ForwardRefused(f"forward endpoint {ep} is not a peer this server may forward to")
    return hops


def not_reached(hops: Collection[str], why: str) -> dict[str, str]:
    return {ep: why for ep in hops}


def forward_report(answer: bytes, forward: Collection[str]) -> dict[str, str]:
    """A sender's view of a push answer: one entry per endpoint it asked to forward to."""
    try:
        data = json.loads(answer) if forward else {}
    except ValueError:
        data = {}
    got = data.get("forwarded") if isinstance(data, dict) else None
    got = got if isinstance(got, dict) else {}
    return {ep: v if isinstance(v := got.get(ep), str) else "not reported by the peer" for ep in forward}


#: What a hop answers for the endpoints after it: the file is on its way (see :class:`Forwarder`).
QUEUED = "queued"
#: After a file of a step did not get through, the rest of that step is not sent on for this long.
BROKEN_FOR_S = 600.0
#: Reports of recent forwards kept for :meth:`Forwarder.status`.
RESULTS_KEPT = 10000


@dataclass
class _Pending:
    relpath: str
    entry: Any
    hops: tuple[str, ...]


class Forwarder:
    """Sends the files this hop stored on to the next hop of their chain, in the background.

    Per namespace, files go on one at a time in the order they were stored here, so the next hop gets
    a part's manifest after its data files (the sender pushes the manifest last). When a file does not
    get through, the later files of its step (its top directory) are not sent to that hop for
    ``BROKEN_FOR_S`` (a manifest never reaches a hop that lacks a file it lists); the sender sees the
    gap in that hop's forward status and copies directly.
    The file goes from the page cache by ``sendfile``, as a sender's push does, and the next hop
    verifies it itself. One client per next hop, made by ``make_client(endpoint)`` (the job's secret,
    the forward TLS context)."""

    def __init__(self, store: Any, make_client: Callable[[str], Any], pool: Any) -> None:
        self.store = store
        self.make_client = make_client
        self.pool = pool
        self._clients: dict[str, Any] = {}
        self._queues: dict[str, collections.deque[_Pending]] = {}
        # (namespace, top directory: a step, next hop) -> when a file under it did not get through
        self._broken: dict[tuple[str, str, str], float] = {}
        self._results: collections.OrderedDict[tuple[str, str], dict[str, str]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def enqueue(self, namespace: str, relpath: str, entry: Any, hops: tuple[str, ...]) -> dict[str, str]:
        """Queue a stored file for the next hop; returns the sender's report (every hop "queued")."""
        with self._lock:
            queue = self._queues.get(namespace)
            start = queue is None
            if start:
                queue = self._queues[namespace] = collections.deque()
            queue.append(_Pending(relpath, entry, hops))
            self._record(namespace, relpath, {ep: QUEUED for ep in hops})
        if start:
            self.pool.submit(self._drain, namespace)
        return {ep: QUEUED for ep in hops}

    def _drain(self, namespace: str) -> None:
        while True:
            with self._lock:
                queue = self._queues[namespace]
                if not queue:
                    del self._queues[namespace]
                    now = time.monotonic()
                    self._broken = {k: t for k, t in self._broken.items() if now - t < BROKEN_FOR_S}
                    return
                item = queue.popleft()
                top = (namespace, item.relpath.split("/", 1)[0], item.hops[0])
                skip = top in self._broken
            if skip:
                report = not_reached(item.hops, "not sent on: an earlier file of its step did not get through")
            else:
                report = self.push_on(namespace, item.relpath, item.entry, item.hops)
            failed = {ep: why for ep, why in report.items() if why not in (OK, QUEUED)}
            with self._lock:
                self._record(namespace, item.relpath, report)
                if failed:
                    self._broken[top] = time.monotonic()
            if failed and not skip:
                log.warning("forwarding %s/%s: %s", namespace, item.relpath, failed)

    def _record(self, namespace: str, relpath: str, report: dict[str, str]) -> None:
        """Remember the latest report of a file (bounded: the oldest are forgotten). Lock held."""
        key = (namespace, relpath)
        self._results.pop(key, None)
        self._results[key] = report
        while len(self._results) > RESULTS_KEPT:
            self._results.popitem(last=False)

    def status(self, namespace: str, relpath: str) -> dict[str, str]:
        """Where the last chain of ``namespace/relpath`` through this hop stands ({}: none known).
        The next hop's own queue is asked by whoever needs the far end (each hop reports its own)."""
        with self._lock:
            return dict(self._results.get((namespace, relpath), {}))

    def _client(self, endpoint: str) -> Any:
        with self._lock:  # made outside the lock: a nicer forward thread never holds up a receive's enqueue
            client = self._clients.get(endpoint)
        if client is None:
            made = self.make_client(endpoint)
            with self._lock:
                client = self._clients.setdefault(endpoint, made)
            if client is not made:
                made.close()
        return client

    def push_on(self, namespace: str, relpath: str, entry: Any, hops: tuple[str, ...]) -> dict[str, str]:
        """Push the stored ``namespace/relpath`` to ``hops[0]`` naming the rest; the report of every
        hop downstream: "ok", "queued", or why not. Never raises."""
        nxt, rest = hops[0], hops[1:]
        try:
            path = self.store.path_of(namespace, relpath)
            sub = self._client(nxt).push_file(namespace, relpath, path, entry, forward=rest)
        except Exception as e:  # noqa: BLE001 - reported; the sender copies directly where needed
            why = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
            why = why.removeprefix(f"push {namespace}/{relpath}: ")  # the sender knows which file
            return {nxt: why, **not_reached(rest, f"not reached: {nxt} failed")}
        return {nxt: OK, **sub}

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
