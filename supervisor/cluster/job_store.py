"""The job's coordination store as this node reaches it: its settings (``coordinator_*`` keys and
``rendezvous_timeout``) and the connection (:func:`connect_coordinator`: etcd, or the embedded store node 0 hosts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.cluster.kvstore import OP_TIMEOUT_S, StoreUnavailable
from supervisor.cluster.round_errors import CoordinationError, NodeZeroRunning
from supervisor.cluster.spares import refuse_if_taken
from supervisor.config import SupervisorConfig
from supervisor.job_identity import JobIdentity
from supervisor.membership import Membership
from supervisor.settings_vocabulary import CoordinatorBackend
from supervisor.stop_request import StopRequest


@dataclass(frozen=True)
class CoordinatorSettings:
    """The coordination store's part of the config (``coordinator_*`` keys and ``rendezvous_timeout``)."""

    backend: CoordinatorBackend = "embedded"
    endpoints: tuple[str, ...] = ()
    port: int = 9780
    rendezvous_timeout: float = 600.0

    @classmethod
    def from_config(cls, cfg: SupervisorConfig) -> "CoordinatorSettings":
        return cls(cfg.coordinator_backend, tuple(cfg.coordinator_endpoints), cfg.coordinator_port,
                   cfg.rendezvous_timeout)

    def hosted_by(self, node_rank: int) -> bool:
        """Whether node ``node_rank``'s rlsup serves the store: the embedded store lives in node 0's (etcd is the
        site's)."""
        return self.backend == "embedded" and node_rank == 0

    @property
    def outlives_node_0(self) -> bool:
        """Whether the store stays when node 0 is lost (etcd); the embedded one goes with node 0's rlsup."""
        return self.backend != "embedded"


def connect_coordinator(cfg: SupervisorConfig, membership: Membership, job: JobIdentity,
                        secret: bytes, stop: StopRequest | None = None,
                        gone_after_s: float | None = None, wait_s: float | None = None) -> RoundCoordinator:
    """This node's handle on the job's coordination store (``coordinator_backend``); ``stop`` ends its waits;
    ``gone_after_s``: see :func:`~supervisor.cluster.embedded_store.embedded_coordinator` (etcd outlives node 0); ``wait_s``:
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


__all__ = ["CoordinatorSettings", "connect_coordinator"]
