"""A node that refuses to start for a clash tells its job's other nodes, so they end too instead of waiting.

Two jobs started at once on the same hosts with the default directories and ports can each take half of
the locks: job C holds host 0's state and replica directories, job D host 1's. Each node that lost its
host refuses (exit 2, naming the job that holds it); without a word from it, its job's node 0 would wait
for it until ``rendezvous_timeout``. So a refusing node reaches its job's coordination store for a short
while (:data:`NOTICE_S`) and publishes the job's ``abort``, marked as a clash
(:class:`~supervisor.cluster.signed_keys.AbortNotice`): every wait of the other nodes looks at it, and they exit
2 as well, naming the clash.

Which store it reaches: with etcd, the job's own keys. With the embedded store, the one on node 0's
host and port, only when that store is hosted for this job (a store of the other job is left alone: this
job's nodes that reach it refuse by themselves). Only a job with no attempt yet is told (its nodes wait in
their first join): a second rlsup started for a node of a job that already runs refuses alone, and the
running job goes on. A refusing node 0 tells nobody: the port it would host
on is the other job's, whose store this job's other nodes reach and refuse; node 0 of the other job,
ended by such a notice, keeps its store up a little (``node_run.CLASH_LINGER_S``) for them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from supervisor.job_identity import JobIdentity
from supervisor.membership import Membership
from supervisor.stop_request import StopAsked, StopRequest

if TYPE_CHECKING:
    from supervisor.cluster.job_store import CoordinatorSettings
    from supervisor.transport.security import TransportSecurity

log = logging.getLogger(__name__)

NOTICE_S = 30.0  # the longest a refusing node tries to reach its job's store (never past rendezvous_timeout)


def tell_job_refused(store_settings: CoordinatorSettings, security: TransportSecurity, membership: Membership,
                     job: JobIdentity, reason: str, stop: StopRequest | None = None) -> str | None:
    """Publish ``abort`` (a clash) in the job's store (``store_settings``, signed with ``security``'s secret);
    where it was told, or None (nothing reached, the store is another job's, or ``stop`` was asked meanwhile).
    Best effort and bounded: never raises."""
    from supervisor.cluster.coordinator import RoundCoordinator
    from supervisor.cluster.round_errors import CoordinationError
    from supervisor.cluster.kvstore import connect_store
    from supervisor.cluster.kvstore import KVStore, StoreUnavailable
    from supervisor.transport.auth import SecretError

    wait_s = min(NOTICE_S, store_settings.rendezvous_timeout)
    why = f"node {membership.node_rank} refused to start: {reason}"
    try:
        secret = security.secret()
        store: KVStore
        if store_settings.backend == "etcd":
            from supervisor.cluster.kvstore_etcd import EtcdKVStore

            store = EtcdKVStore(list(store_settings.endpoints), timeout_s=wait_s)
        elif store_settings.hosted_by(membership.node_rank):
            return None  # the store this node would have hosted never started: nobody is there to tell
        else:
            store = connect_store(membership.peers[0].rpartition(":")[0], store_settings.port, secret, wait_s, stop)
        coordinator = RoundCoordinator(store, job, secret, membership.node_rank, membership.size, wait_s, stop=stop)
        if store_settings.backend != "etcd":
            coordinator.check_host()  # JobClash: the other job's store, not ours to write in
        running = coordinator.current_attempt()
        if running is not None:  # a second rlsup for a node of a running job: nobody waits for it
            log.info("node %d: the job already runs (attempt %d): its nodes are not told of this refusal",
                     membership.node_rank, running)
            return None
        coordinator.abort(why, clash=True)
    except (SecretError, StoreUnavailable, CoordinationError, OSError, ImportError, StopAsked) as e:
        log.info("node %d: the job's other nodes were not told of this refusal: %s", membership.node_rank, e)
        return None
    log.warning("node %d refuses to start; told the job's other nodes through %s (they stop too)",
                membership.node_rank, store.describe())
    return store.describe()
