"""The per-node replication service: endpoint, replica store, peer clients and the replication engine.

``rlsup daemon`` runs one for the node's lifetime; ``rlsup run`` embeds one when no daemon serves the
node's state directory (``daemon.json`` names a live pid), and otherwise uses only its inventory and
fetch functions, which read the same directories.
"""

from __future__ import annotations

import json
import os
import logging
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from rlsup_format.fileio import write_durable
from rlsup_format.leftovers import clean_leftovers
from rlsup_format.names import Kind, reserved_name
from rlsup_format.state_files import DAEMON, REPLICATION
from supervisor.config import SupervisorConfig
from supervisor.cluster.dir_lock import DirLock
from supervisor.job_identity import JobIdentity
from supervisor.membership import Membership
from supervisor.observer import Observer
from supervisor.tiers.replication import ReplicationEngine, ReplicationSettings, newest_own_step

log = logging.getLogger(__name__)


def _server_ssl(cfg: SupervisorConfig) -> ssl.SSLContext | None:
    if not cfg.tls_cert:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    return ctx


def _client_ssl(cfg: SupervisorConfig) -> ssl.SSLContext | None:
    if not cfg.tls_cert:
        return None
    ctx = ssl.create_default_context(cafile=cfg.tls_ca or None)
    ctx.check_hostname = False  # peers are addressed by IP or short host name; the CA pins identity
    return ctx


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
    cfg: SupervisorConfig
    membership: Membership
    observer: Observer = field(default_factory=Observer)
    serve: bool = True
    job: JobIdentity = field(default_factory=lambda: JobIdentity("job", "default"))
    server: object | None = None
    engine: ReplicationEngine | None = None
    port: int | None = None
    _lock: DirLock | None = None

    def start(self) -> "NodeService":
        from supervisor.transport.auth import load_secret
        from supervisor.transport.client import BandwidthLimiter, PeerClient, TransferPool
        from supervisor.transport.server import ReplicationServer
        from supervisor.transport.store import ReplicaStore

        if not self.cfg.token_file:
            raise ValueError("key 'token_file': replication between nodes needs a shared secret file")
        secret = load_secret(self.cfg.token_file)
        limiter = BandwidthLimiter(self.cfg.replication_bandwidth) if self.cfg.replication_bandwidth else None
        client_ssl = _client_ssl(self.cfg)
        pool = TransferPool(self.cfg.replication_concurrency)  # one bound for all peers of this node
        clients = {n: PeerClient(ep, secret, limiter=limiter, ssl_context=client_ssl, pool=pool)
                   for n, ep in enumerate(self.membership.peers) if n != self.membership.node_rank}
        state_dir = Path(self.cfg.state_dir)
        self.engine = ReplicationEngine(
            membership=self.membership, checkpoint_dir=Path(self.cfg.checkpoint_dir),
            replica_root=Path(self.cfg.replica_dir), clients=clients,
            settings=ReplicationSettings.from_config(self.cfg), state_path=state_dir / REPLICATION,
            observer=self.observer, job=self.job.id)
        if not self.serve:
            return self
        # One server per replica directory: two jobs sharing the relative default must not both serve it.
        self._lock = DirLock(self.cfg.replica_dir, ".serve.lock", "replica_dir", self.job.id).acquire()
        host, _, port = self.membership.me.rpartition(":")
        store = ReplicaStore(self.cfg.replica_dir)
        # A chain of copies is forwarded from node to node: only to this job's other nodes, as named here.
        others = [ep for n, ep in enumerate(self.membership.peers) if n != self.membership.node_rank]
        self.server = ReplicationServer(store, secret, host=host, port=int(port), ssl_context=_server_ssl(self.cfg),
                                        forward_peers=others, own_endpoint=self.membership.me,
                                        forward_ssl=client_ssl)
        self.port = self.server.start()
        self.engine.start()
        log.info("node %d: replication endpoint %s:%d, copies of this node's checkpoints go to nodes %s",
                 self.membership.node_rank, host, self.port, self.engine.targets)
        return self

    def write_daemon_file(self) -> None:
        state_dir = Path(self.cfg.state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        clean_leftovers(state_dir, {Kind.TMP})  # a temp daemon file of a killed daemon
        data = json.dumps({"pid": os.getpid(), "port": self.port, "node_rank": self.membership.node_rank})
        write_durable(state_dir / DAEMON, data.encode(), state_dir / reserved_name(Kind.TMP, DAEMON))

    def stop(self, stopped: Callable[[], bool] = lambda: False) -> None:
        """The last replication pass (cut short once ``stopped()``), then the server, lock and clients."""
        if self.engine is not None and self.serve:
            # The last pass copies this node's newest parts; with none (stopped or refused before any
            # checkpoint) there is nothing to lose, and a gone peer would only hold the exit for seconds.
            if newest_own_step(Path(self.cfg.checkpoint_dir), self.membership.node_rank) is not None:
                self.engine.drain(timeout=60, stopped=stopped)
            self.engine.stop()
        if self.server is not None:
            self.server.stop()
        if self._lock is not None:
            self._lock.release()
        if self.engine is not None:
            for client in self.engine.clients.values():
                client.close()
        path = Path(self.cfg.state_dir) / DAEMON
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass
