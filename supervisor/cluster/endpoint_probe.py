"""Whether a peer's rlsup is gone, told by its own host: refused connects to its replication endpoint.

A node missing from a round is either lost or slow (a long teardown, a loaded host, a stalled store
connection); silence cannot tell them apart, so a spare waits ``spare_takeover_s`` for it. But a host that is up
and answers TCP connects to the node's endpoint with refusals (RST: nothing listens on that port) says that
nothing serves the node's replication there any more: its rlsup (or the ``rlsup daemon`` serving it) was killed,
crashed or exited. That is evidence, not a guess, and the spare need not wait out the rest of its window for it.
A timeout, an unreachable network or a name that does not resolve is silence: only the window decides then (a
host that lost power answers nothing). A stopped (SIGSTOP) or hung rlsup still has its socket, whose backlog
the kernel keeps accepting into: never called gone here. An rlsup that restarts (systemd's ``Restart=``) is
refused for the time its start-up takes (0.5-1 s to import and bind): it loses its rank to a spare and comes
back as a late node (exit 77), as one that restarted after the window does; its ranks were ended with it anyway.

Probes run in a thread of their own, one in flight per endpoint, each bounded by :data:`PROBE_TIMEOUT_S`
(name resolution has no timeout of its own, and a resolver that drops queries must not hold the caller). An
endpoint counts as gone once at least :data:`MIN_REFUSALS` probes in a row were refused over at least
:data:`~supervisor.settings_vocabulary.REFUSED_FOR_S` (``spare_takeover_s``'s help quotes it), and no probe
since has been out longer than :data:`PROBE_PENDING_S` (a probe that hangs is silence starting, not more of the
refusal). Every address a name resolves to must refuse.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from supervisor.settings_vocabulary import REFUSED_FOR_S

PROBE_TIMEOUT_S = 1.0  # a connect that takes longer is silence, not a refusal
MIN_REFUSALS = 3  # refused at least this many times in a row (over REFUSED_FOR_S): the endpoint's rlsup is gone
PROBE_PENDING_S = 0.3  # a probe out longer than this (a lost SYN, a stalled lookup) suspends the verdict


def connect_refused(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when every address of ``host:port`` refused a TCP connect; False when one accepted, timed out or
    could not be reached (silence), or the endpoint is malformed."""
    host, _, port = endpoint.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return False
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout_s)
                sock.connect(address)
            return False
        except ConnectionRefusedError:
            continue
        except OSError:
            return False
    return bool(infos)


@dataclass
class _Probe:
    first_refused: float | None = None  # monotonic start of the first probe of the current run of refusals
    last_refused: float | None = None  # monotonic start of the newest refused probe
    refusals: int = 0
    out_since: float | None = None  # start of the probe in flight


@dataclass
class EndpointProbe:
    """How long each endpoint has refused connects, probed in the background when asked (see the module
    docstring)."""

    refused_for_s: float = REFUSED_FOR_S
    check: Callable[[str], bool] = connect_refused  # one probe: True when refused
    _probes: dict[str, _Probe] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gone(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is gone by the probes so far; starts a probe when none is in flight (call it once
        per poll)."""
        now = time.monotonic()
        with self._lock:
            probe = self._probes.setdefault(endpoint, _Probe())
            pending = probe.out_since is not None and now - probe.out_since > PROBE_PENDING_S
            verdict = (not pending and probe.refusals >= MIN_REFUSALS and probe.first_refused is not None
                       and probe.last_refused is not None
                       and probe.last_refused - probe.first_refused >= self.refused_for_s)
            if probe.out_since is None:
                probe.out_since = now
                threading.Thread(target=self._probe, args=(endpoint, probe, now), name=f"probe {endpoint}",
                                 daemon=True).start()
        return verdict

    def forget(self, endpoint: str) -> None:
        """Drop what was seen of ``endpoint``: its node is back, or a new round asks afresh (a probe in flight
        reports into the forgotten record, never into a new one)."""
        with self._lock:
            self._probes.pop(endpoint, None)

    def _probe(self, endpoint: str, probe: _Probe, started: float) -> None:
        try:
            refused = self.check(endpoint)
        except Exception:  # noqa: BLE001 - a check that fails says nothing: silence; the next poll probes again
            refused = False
        with self._lock:
            if refused:
                probe.first_refused = started if probe.first_refused is None else probe.first_refused
                probe.last_refused = started
                probe.refusals += 1
            else:
                probe.first_refused = probe.last_refused = None
                probe.refusals = 0
            probe.out_since = None


def all_gone(endpoints: list[str], within_s: float = 4 * REFUSED_FOR_S, poll_s: float = 0.1,
             between: Callable[[], None] = lambda: None) -> bool:
    """Whether every one of ``endpoints`` is gone (:meth:`EndpointProbe.gone`) within ``within_s``: False once
    the deadline passes with one still answering, silent or unresolved. ``between`` runs between polls (a stop
    request's check may raise there)."""
    probe = EndpointProbe()
    deadline = time.monotonic() + within_s
    while True:
        if all([probe.gone(e) for e in endpoints]):  # a list: every endpoint probed on every poll
            return True
        if time.monotonic() >= deadline:
            return False
        between()
        time.sleep(poll_s)


__all__ = ["all_gone", "EndpointProbe", "connect_refused", "PROBE_TIMEOUT_S", "MIN_REFUSALS"]
