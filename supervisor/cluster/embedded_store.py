"""The embedded coordination store: node 0's rlsup hosts it for its job (as torchrun's c10d rendezvous hosts its
own ``TCPStore``; :mod:`supervisor.cluster.kv_server`), the other nodes reach it, and a store hosted for another job on the same port is named
and refused (see :mod:`supervisor.cluster.coordinator` for what the nodes keep in it)."""

from __future__ import annotations

import logging

from supervisor.cluster.store_host import HOST_KEY, claim_store, clash, store_holder
from supervisor.cluster.coordinator import RoundCoordinator

from supervisor.cluster.round_errors import CoordinationError, JobClash, NodeZeroRunning
from supervisor.cluster.kvstore import EmbeddedKVStore, KVStore, StoreGone, StoreRefused, StoreUnavailable, connect_store
from supervisor.cluster.liveness import beat_connect
from supervisor.job_identity import JobIdentity
from supervisor.stop_request import StopRequest

log = logging.getLogger(__name__)


def embedded_coordinator(host: str, port: int, job: JobIdentity, secret: bytes, node_rank: int, num_nodes: int,
                         timeout_s: float, stop: StopRequest | None = None,
                         gone_after_s: float | None = None) -> RoundCoordinator:
    """Node 0 hosts the store on ``port`` and claims it for ``job``; other nodes connect (and reconnect to
    a replacement node 0 after a loss) and refuse a store hosted for another job. ``stop``: every wait
    (the connect included) ends when rlsup is asked to stop. ``gone_after_s``: the first connect raises
    :class:`~supervisor.cluster.kvstore.StoreGone` once a store that answered has refused this long (a spare)."""
    if node_rank == 0:
        try:
            store = EmbeddedKVStore(host, port, secret, True, timeout_s, serves={"job": job.id, "source": job.source})
        except StoreUnavailable as e:
            holder = _hosted_for(host, port, job, secret)
            if holder is None:
                raise CoordinationError(str(e)) from e
            kind = NodeZeroRunning if holder == _SAME_JOB else JobClash
            raise kind(f"coordinator port {port} on {host} is taken{holder}; this node is job {job}. Give each "
                       "job on these hosts its own coordinator_port") from e
        coordinator = RoundCoordinator(store, job, secret, node_rank, num_nodes, timeout_s, stop=stop,
                                       beat_store=beat_connect(host, port, secret))
        claim_store(coordinator.keys, job)
        return coordinator

    def connect(wait_s: float) -> KVStore:
        try:
            return connect_store(host, port, secret, wait_s, stop)
        except StoreRefused as e:  # node 0's port now serves another job: a clash, not an outage to wait out
            raise clash(f"{host}:{port}", f"{e.serves} (it refused this job's secret)", job) from e

    log.info("node %d: reaching the coordination store %s:%d (up to %.0fs, rendezvous_timeout)",
             node_rank, host, port, timeout_s)
    try:
        store = connect_store(host, port, secret, timeout_s, stop, gone_after_s)
    except StoreRefused as e:
        raise clash(f"{host}:{port}", f"{e.serves} (it refused this job's secret)", job) from e
    except StoreGone:
        raise
    except StoreUnavailable as e:
        raise CoordinationError(f"{e} (waited {timeout_s:.0f}s, rendezvous_timeout)") from e
    coordinator = RoundCoordinator(store, job, secret, node_rank, num_nodes, timeout_s, reconnect=connect, stop=stop,
                                   beat_store=beat_connect(host, port, secret))
    coordinator.check_host()
    return coordinator


def _hosted_for(host: str, port: int, job: JobIdentity, secret: bytes) -> str | None:
    """What holds a port node 0 could not bind: " by rlsup job X", " by another program", or None."""
    try:
        probe = RoundCoordinator(EmbeddedKVStore(host, port, secret, False, 2.0), job, secret, 0, 1, 2.0)
        raw = probe.store.get(HOST_KEY)
    except StoreRefused as e:
        return f" by {e.serves} (it refused this job's secret)"
    except StoreUnavailable:
        return " by another program"
    if raw is None:
        return " by another program (no rlsup job record)"
    other = store_holder(probe.keys, raw)
    return f" by {other}" if other is not None else _SAME_JOB


_SAME_JOB = " by another node 0 of this same job (is it running twice?)"


__all__ = ["embedded_coordinator"]
