"""A real etcd cluster on 127.0.0.1 for tests: start it, SIGKILL and restart members, stop it.

Not a test module. Tests take the :func:`etcd_cluster` fixture (``from etcd_cluster import etcd_cluster``);
it skips the test, saying why, when Debian's ``etcd`` binary (package ``etcd-server``) is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pytest

from support.ports import free_ports
from support.waits import wait_for

START_TIMEOUT_S = 30.0  # a cold start of 3 members is ~1 s; generous for a loaded CI machine


def etcd_binary() -> str | None:
    """The ``etcd`` server binary (Debian installs /usr/bin/etcd), or None."""
    found = shutil.which("etcd")
    if found:
        return found
    return "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1, each with its own free client and peer port and data dir.

    etcd's default heartbeat (100 ms) and election timeout (1000 ms) are kept so that failover times
    measured against this cluster are the ones a real deployment sees. ``hosts`` (member addresses, default
    127.0.0.1) and ``wrap`` (a member's command prefix) put members in nodes' namespaces (support.partition).
    """

    def __init__(self, base_dir: Path, size: int = 3, binary: str | None = None, hosts: Sequence[str] | None = None,
                 wrap: Callable[[int], list[str]] | None = None) -> None:
        self.hosts = list(hosts or ["127.0.0.1"] * size)
        self.wrap = wrap or (lambda i: [])
        self.binary = binary or etcd_binary()
        if self.binary is None:
            raise FileNotFoundError("etcd binary not found (Debian/Ubuntu: apt-get install etcd-server)")
        self.base_dir = base_dir
        self.names = [f"m{i}" for i in range(size)]
        ports = free_ports(2 * size)
        self.client_ports, self.peer_ports = ports[:size], ports[size:]
        self.procs: list[subprocess.Popen | None] = [None] * size
        self._initial_cluster = ",".join(
            f"{n}=http://{h}:{p}" for n, h, p in zip(self.names, self.hosts, self.peer_ports))

    @property
    def endpoints(self) -> list[str]:
        """The members' client addresses, ``127.0.0.1:port``, in member order."""
        return [f"{h}:{p}" for h, p in zip(self.hosts, self.client_ports)]

    def _spawn(self, i: int, state: str) -> None:
        data_dir = self.base_dir / self.names[i]
        client = f"http://{self.hosts[i]}:{self.client_ports[i]}"
        peer = f"http://{self.hosts[i]}:{self.peer_ports[i]}"
        log = open(self.base_dir / f"{self.names[i]}.log", "ab")
        try:
            self.procs[i] = subprocess.Popen(
                [*self.wrap(i), self.binary, "--name", self.names[i], "--data-dir", str(data_dir),
                 "--listen-client-urls", client, "--advertise-client-urls", client,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", self._initial_cluster, "--initial-cluster-state", state,
                 "--initial-cluster-token", f"rlsup-test-{os.getpid()}-{self.peer_ports[0]}",
                 "--logger", "zap", "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()

    def member_healthy(self, i: int) -> bool:
        """Member ``i`` runs and reports ``/health`` true (it sees a leader: the cluster has quorum)."""
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://{self.hosts[i]}:{self.client_ports[i]}/health", timeout=1) as r:
                return json.load(r).get("health") == "true"
        except (OSError, ValueError):
            return False

    def _wait_healthy(self, members: list[int], what: str) -> None:
        def check() -> bool:
            for i in members:
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    raise AssertionError(f"etcd member {self.names[i]} exited with {proc.returncode} "
                                         f"while {what}:\n{self.log_tail(i)}")
            return all(self.member_healthy(i) for i in members)

        wait_for(check, START_TIMEOUT_S, what)

    def start(self) -> "EtcdCluster":
        """Start every member and wait until all report healthy."""
        self.base_dir.mkdir(parents=True, exist_ok=True)
        for i in range(len(self.names)):
            self._spawn(i, "new")
        self._wait_healthy(list(range(len(self.names))), "the etcd cluster to become healthy")
        return self

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (no clean shutdown, as a lost node) and reap it."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        self.procs[i] = None

    def restart(self, i: int) -> None:
        """Start a killed member again on its data dir and wait until it is healthy (it has rejoined)."""
        if self.procs[i] is not None and self.procs[i].poll() is None:
            return
        self._spawn(i, "existing")
        self._wait_healthy([i], f"etcd member {self.names[i]} to rejoin")

    def index_of(self, endpoint: str) -> int:
        """The member serving ``endpoint`` (``host:port``)."""
        return self.client_ports.index(int(endpoint.rsplit(":", 1)[1]))

    def wipe(self) -> None:
        """Delete every key (through a live member), so tests sharing a cluster start from nothing."""
        for i in range(len(self.names)):
            if self.member_healthy(i):
                body = json.dumps({"key": "AA==", "range_end": "AA=="}).encode()  # "\0".."\0": all keys
                url = f"http://{self.hosts[i]}:{self.client_ports[i]}/v3/kv/deleterange"
                with urllib.request.urlopen(urllib.request.Request(url, body), timeout=5):
                    return
        raise AssertionError("no healthy etcd member to wipe the cluster through")

    def log_tail(self, i: int, chars: int = 2000) -> str:
        path = self.base_dir / f"{self.names[i]}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self) -> None:
        """Stop every member. SIGKILL: the data is thrown away, and a SIGTERMed member of a cluster that is
        stopping whole waits seconds trying to hand its leadership over."""
        for i in range(len(self.procs)):
            self.kill(i)

    def __enter__(self) -> "EtcdCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _skip_without_etcd() -> None:
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (Debian/Ubuntu package etcd-server; scripts/install_system_deps.sh)")


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A fresh, healthy 3-member etcd cluster on 127.0.0.1 for one test (it may kill members); stopped after."""
    _skip_without_etcd()
    with EtcdCluster(tmp_path / "etcd") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shared_etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One cluster for a module's tests that leave its members alone (a start costs 1-2 s of election).

    Each test gets it wiped and with every member healthy; a test that kills members uses
    :func:`etcd_cluster` instead.
    """
    _skip_without_etcd()
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


@pytest.fixture
def etcd_cluster_clean(shared_etcd_cluster: EtcdCluster) -> EtcdCluster:
    """:func:`shared_etcd_cluster`, all members up and no keys."""
    for i in range(len(shared_etcd_cluster.names)):
        shared_etcd_cluster.restart(i)  # a no-op for a running member
    shared_etcd_cluster.wipe()
    return shared_etcd_cluster
