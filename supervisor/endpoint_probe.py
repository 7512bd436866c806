"""Whether a peer's rlsup is gone, told by its own host: a refused connect to its replication endpoint.

A node missing from a round is either lost or slow (a long teardown, a loaded host, a stalled store
connection); silence cannot tell them apart, so a spare waits ``spare_takeover_s`` for it. But a host that is up
and answers a TCP connect to the node's endpoint with a refusal (RST: nothing listens on that port) says that
the node's rlsup, which serves that port for its whole run, is no longer there: killed, crashed, or exited.
That is evidence, not a guess, and the spare need not wait out the rest of its window for it. A timeout, an
unreachable network or a name that does not resolve is silence: only the window decides then (a host that
lost power answers nothing). A stopped (SIGSTOP) or hung rlsup still has its socket, whose backlog the kernel
keeps accepting into: never called gone here.

Probes run in a thread of their own, one in flight per endpoint, each bounded by :data:`PROBE_TIMEOUT_S`
(name resolution has no timeout of its own, and a resolver that drops queries must not hold the spare's
watch). An endpoint counts as gone once every probe for :data:`REFUSED_FOR_S` was refused: one refusal is a
moment (a port being rebound by an rlsup that restarts at once is refused for a moment, and is welcome back).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

PROBE_TIMEOUT_S = 1.0  # a connect that takes longer is silence, not a refusal
REFUSED_FOR_S = 0.5  # refused without a break this long: the endpoint's rlsup is gone


def connect_refused(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when ``host:port`` refused a TCP connect; False when it accepted, timed out or could not be
    reached (silence)."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


@dataclass
class _Probe:
    refused_since: float | None = None  # monotonic start of the current run of refusals
    in_flight: bool = False


@dataclass
class EndpointProbe:
    """How long each endpoint has refused connects, probed in the background when asked (see the module
    docstring)."""

    refused_for_s: float = REFUSED_FOR_S
    _probes: dict[str, _Probe] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def gone(self, endpoint: str) -> bool:
        """Whether ``endpoint`` has refused every probe for ``refused_for_s``; starts a probe when none is in
        flight (call it once per poll: the answer is the previous probes')."""
        with self._lock:
            probe = self._probes.setdefault(endpoint, _Probe())
            since = probe.refused_since
            if not probe.in_flight:
                probe.in_flight = True
                threading.Thread(target=self._probe, args=(endpoint, probe), name=f"probe {endpoint}",
                                 daemon=True).start()
        return since is not None and time.monotonic() - since >= self.refused_for_s

    def _probe(self, endpoint: str, probe: _Probe) -> None:
        started = time.monotonic()
        refused = connect_refused(endpoint)
        with self._lock:
            if not refused:
                probe.refused_since = None
            elif probe.refused_since is None:
                probe.refused_since = started
            probe.in_flight = False


__all__ = ["EndpointProbe", "connect_refused", "PROBE_TIMEOUT_S", "REFUSED_FOR_S"]
