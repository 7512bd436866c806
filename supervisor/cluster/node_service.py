"""The per-node replication service: endpoint, replica store, peer clients and the replication engine.

``rlsup daemon`` runs one for the node's lifetime; ``rlsup run`` embeds one when no daemon serves the
node's state directory (``daemon.json`` names a live pid), and otherwise uses only its inventory and
fetch functions, which read the same directories.
"""

from __future__ import annotations

import json
import os
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import psutil

from rlsup_format.fileio import write_durable
from rlsup_format.leftovers import clean_leftovers
from rlsup_format.names import Kind, reserved_name
from rlsup_format.state_files import DAEMON, REPLICATION
from supervisor.cluster.dir_lock import DirLock
from supervisor.job_identity import JobIdentity
from supervisor.membership import Membership
from supervisor.observer import Observer
from supervisor.tiers.replication import ReplicationEngine, ReplicationSettings, newest_own_step
from supervisor.transport.security import TransportSecurity

if TYPE_CHECKING:
    from supervisor.config import SupervisorConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeServiceSettings:
    """The service's part of the config: its directories (absolute: from ``SupervisorConfig.resolved()``), the
    transfers' bounds, the replication engine's settings and the transport's credentials."""

    state_dir: Path
    checkpoint_dir: Path
    replica_dir: Path
    bandwidth: float  # replication_bandwidth: bytes/s over all peers (0: unlimited)
    concurrency: int  # replication_concurrency: transfers in flight at once, all peers together
    replication: ReplicationSettings
    security: TransportSecurity

    @classmethod
    def from_config(cls, cfg: SupervisorConfig) -> "NodeServiceSettings":
        """``cfg`` resolved (absolute paths)."""
        return cls(Path(cfg.state_dir), Path(cfg.checkpoint_dir), Path(cfg.replica_dir), cfg.replication_bandwidth,
                   cfg.replication_concurrency, ReplicationSettings.from_config(cfg),
                   TransportSecurity.from_config(cfg))


def daemon_running(state_dir: Path) -> dict | None:
    """The live daemon serving ``state_dir``, if any."""
    try:
        info = json.loads((state_dir / DAEMON).read_text())
        if psutil.pid_exists(int(info["pid"])) and int(info["pid"]) != os.getpid():
            return info
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


@dataclass
class NodeService:
    """This node's replication service, built from its own settings (:class:`NodeServiceSettings`): call
    :meth:`start` once, :meth:`stop` at the end. ``serve``: False where a daemon serves the node already."""

    settings: NodeServiceSettings
    membership: Membership
    observer: Observer = field(default_factory=Observer)
    serve: bool = True
    job: JobIdentity = field(default_factory=lambda: JobIdentity("job", "default"))
    server: object | None = None
    engine: ReplicationEngine | None = None
    port: int | None = None
    _lock: DirLock | None = None

    def start(self) -> "NodeService":
        from supervisor.transport.client import BandwidthLimiter, PeerClient, TransferPool
        from supervisor.transport.server import ReplicationServer
        from supervisor.transport.store import ReplicaStore

        s = self.settings
        secret = s.security.secret()
        limiter = BandwidthLimiter(s.bandwidth) if s.bandwidth else None
        client_ssl = s.security.client_context()
        pool = TransferPool(s.concurrency)  # one bound for all peers of this node
        clients = {n: PeerClient(ep, secret, limiter=limiter, ssl_context=client_ssl, pool=pool)
                   for n, ep in enumerate(self.membership.peers) if n != self.membership.node_rank}
        self.engine = ReplicationEngine(
            membership=self.membership, checkpoint_dir=s.checkpoint_dir, replica_root=s.replica_dir, clients=clients,
            settings=s.replication, state_path=s.state_dir / REPLICATION,
            observer=self.observer, job=self.job.id)
        if not self.serve:
            return self
        # One server per replica directory: two jobs sharing the relative default must not both serve it.
        self._lock = DirLock(s.replica_dir, ".serve.lock", "replica_dir", self.job.id).acquire()
        host, _, port = self.membership.me.rpartition(":")
        store = ReplicaStore(s.replica_dir)
        # A chain of copies is forwarded from node to node: only to this job's other nodes, as named here.
        others = [ep for n, ep in enumerate(self.membership.peers) if n != self.membership.node_rank]
        self.server = ReplicationServer(store, secret, host=host, port=int(port),
                                        ssl_context=s.security.server_context(), forward_peers=others,
                                        own_endpoint=self.membership.me, forward_ssl=client_ssl)
        self.port = self.server.start()
        self.engine.start()
        log.info("node %d: replication endpoint %s:%d, copies of this node's checkpoints go to nodes %s",
                 self.membership.node_rank, host, self.port, self.engine.targets)
        return self

    def write_daemon_file(self) -> None:
        state_dir = self.settings.state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        clean_leftovers(state_dir, {Kind.TMP})  # a temp daemon file of a killed daemon
        data = json.dumps({"pid": os.getpid(), "port": self.port, "node_rank": self.membership.node_rank})
        write_durable(state_dir / DAEMON, data.encode(), state_dir / reserved_name(Kind.TMP, DAEMON))

    def stop(self, stopped: Callable[[], bool] = lambda: False) -> None:
        """The last replication pass (cut short once ``stopped()``), then the server, lock and clients."""
        if self.engine is not None and self.serve:
            # The last pass copies this node's newest parts; with none (stopped or refused before any
            # checkpoint) there is nothing to lose, and a gone peer would only hold the exit for seconds.
            if newest_own_step(self.settings.checkpoint_dir, self.membership.node_rank) is not None:
                self.engine.drain(timeout=60, stopped=stopped)
            self.engine.stop()
        if self.server is not None:
            self.server.stop()
        if self._lock is not None:
            self._lock.release()
        if self.engine is not None:
            for client in self.engine.clients.values():
                client.close()
        path = self.settings.state_dir / DAEMON
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass
