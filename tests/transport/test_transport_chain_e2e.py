"""Chain replication over real HTTP on 127.0.0.1 with real HMAC: a file pushed once, to the first
peer, is streamed on by each hop to the next as it arrives (supervisor.transport.forward); a
replication pass with factor 2 sends each byte once and falls back to direct copies."""

from __future__ import annotations

import os
import socket
import ssl
import threading
from pathlib import Path

import pytest
import xxhash

from support.files import make_file  # the same test files as the transport tests
from support.ports import free_ports
from support.waits import wait_for
from rlsup_format.digest import FileEntry
from rlsup_format.manifest import SCHEMA_VERSION, RankManifest, manifest_name
from rlsup_format.names import step_dir_name
from supervisor.job_identity import namespace_of
from supervisor.membership import Membership
from supervisor.tiers.parts import scan_parts
from supervisor.tiers.replication import ReplicationEngine, ReplicationSettings
from supervisor.transport.auth import auth_headers
from supervisor.transport.client import PeerClient, TransportError
from supervisor.transport.forward import FORWARD_NICENESS
from supervisor.transport.server import ReplicationServer
from supervisor.transport.store import ReplicaStore

SECRET = b"chain-secret-chain-secret-chain!"
REL = "step_000000005/shard.bin"


class Node:
    """A replica store and its server on 127.0.0.1 (``port`` fixed when the allow-lists need it)."""

    def __init__(self, root: Path, port: int = 0, **kw) -> None:
        self.root = root
        self.store = ReplicaStore(root)
        self.server = ReplicationServer(self.store, SECRET, port=port, **kw)
        self.port = self.server.start()
        self.endpoint = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop()

    def files(self, ns: str = "ns") -> dict[str, FileEntry]:
        return self.store.index(ns)

    def incoming_empty(self) -> bool:
        return os.listdir(self.root / ".incoming") == []


class CountingProxy:
    """A TCP relay in front of a server that counts the bytes its clients send (what left the sender)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.sent = 0
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._sock.accept()
            except OSError:
                return
            try:
                s = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the server is down: so is the relay's connection
                c.close()
                continue
            threading.Thread(target=self._pump, args=(c, s, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(s, c, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if count:
                    with self._lock:
                        self.sent += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def nodes(tmp_path: Path):
    made: list[Node] = []

    def make(name: str, **kw) -> Node:
        kw.setdefault("request_timeout", 5.0)
        n = Node(tmp_path / name, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.stop()


def client(endpoint: str, **kw) -> PeerClient:
    kw.setdefault("retries", 0)
    return PeerClient(endpoint, SECRET, **kw)


def head_answer(port: int, request_path: str, signed_path: str, size: int, digest: str,
                body: bytes = b"", expect: bool = True) -> bytes:
    """Send a PUT head (signed for ``signed_path``, sent as ``request_path``), then ``body``; the
    first line the server answers."""
    headers = auth_headers(SECRET, "PUT", signed_path, size, digest)
    if expect:
        headers["Expect"] = "100-continue"
    head = f"PUT {request_path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        return s.recv(4096).split(b"\r\n", 1)[0]


def settled(peer_client, relpath: str) -> dict[str, str]:
    """The peer's report of its forward of ``ns/relpath``, once its next hop is no longer queued."""
    def done():
        got = peer_client.forward_status("ns", relpath)
        return got if got and next(iter(got.values())) != "queued" else None

    return wait_for(done, 15, f"the forward of {relpath} to settle")


# ------------------------------------------------------------ transport

def test_chain_sends_once_and_every_hop_stores(nodes, tmp_path: Path) -> None:
    d = nodes("d")
    c = nodes("c", forward_peers={d.endpoint})
    b = nodes("b", forward_peers={c.endpoint, d.endpoint})
    proxy = CountingProxy(b.port)
    src = tmp_path / "src.bin"
    entry = make_file(src, 9 * 1024 * 1024 + 77, seed=3)
    a = client(proxy.endpoint)
    try:
        report = a.push_file("ns", REL, src, entry, forward=[c.endpoint, d.endpoint])
        pushed = proxy.sent  # before the status polls below, which pass the same proxy (more of them under load)
        assert report == {c.endpoint: "queued", d.endpoint: "queued"}  # answered once b stored it
        # b sent it on to c, c to d: each hop says how its own forward went.
        assert settled(a, REL) == {c.endpoint: "ok", d.endpoint: "queued"}
        cc = client(c.endpoint)
        try:
            assert settled(cc, REL) == {d.endpoint: "ok"}
        finally:
            cc.close()
        for n in (b, c, d):
            assert n.files() == {REL: entry}
            assert n.store.path_of("ns", REL).read_bytes() == src.read_bytes()
            assert n.incoming_empty()
        assert entry.size <= pushed < entry.size + 4096  # the body left the sender once
        # No forward list: the answer is as before, and the report empty.
        assert a.push_file("ns", "step_000000005/other.bin", src, entry) == {}
        assert c.files() == {REL: entry}
    finally:
        a.close()
        proxy.close()


@pytest.mark.skipif(not hasattr(threading, "get_native_id") or os.uname().sysname != "Linux", reason="per-thread nice")
def test_forward_threads_run_nicer_than_the_receive(nodes, tmp_path: Path) -> None:
    """A hop's forward is background work: its threads yield the CPU to the hop's own receives."""
    c = nodes("c")
    b = nodes("b", forward_peers={c.endpoint})
    src = tmp_path / "src.bin"
    entry = make_file(src, 1024 * 1024, seed=5)
    a = client(b.endpoint)
    try:
        a.push_file("ns", REL, src, entry, forward=[c.endpoint])
        assert settled(a, REL) == {c.endpoint: "ok"}
    finally:
        a.close()
    forwarders = [t for t in threading.enumerate() if t.name.startswith("rlsup-forward")]
    assert forwarders
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for t in forwarders:
        assert os.getpriority(os.PRIO_PROCESS, t.native_id) == min(19, base + FORWARD_NICENESS), t.name


def test_forward_outside_the_allow_list_is_refused_before_the_body(nodes, tmp_path: Path) -> None:
    c = nodes("c")
    b = nodes("b", forward_peers={c.endpoint})
    src = tmp_path / "src.bin"
    entry = make_file(src, 300_000, seed=4)
    a = client(b.endpoint)
    try:
        stranger = "127.0.0.1:1"
        with pytest.raises(TransportError) as ei:
            a.push_file("ns", REL, src, entry, forward=[stranger])
        assert ei.value.status == 400 and stranger in str(ei.value) and "not a peer" in str(ei.value)
        with pytest.raises(TransportError, match="loop") as ei:
            a.push_file("ns", REL, src, entry, forward=[c.endpoint, b.endpoint])
        assert ei.value.status == 400
        with pytest.raises(TransportError, match="at most 8") as ei:
            a.push_file("ns", REL, src, entry, forward=[f"127.0.0.1:{2000 + i}" for i in range(9)])
        for bad in (f"forward={c.endpoint},", "forward=", f"hops={c.endpoint}", f"forward={c.endpoint}&x=1"):
            path = f"/v1/files/ns/{REL}?{bad}"
            # Answered with the refusal instead of "100 Continue": the body is never read.
            assert b" 400 " in head_answer(b.port, path, path, entry.size, entry.xxh3_128)
        assert b.files() == {} and c.files() == {} and b.incoming_empty()
    finally:
        a.close()


def test_tampered_forward_list_is_refused_403(nodes, tmp_path: Path) -> None:
    d = nodes("d")
    c = nodes("c")
    b = nodes("b", forward_peers={c.endpoint, d.endpoint})
    data = os.urandom(50_000)
    digest = xxhash.xxh3_128_hexdigest(data)
    signed = f"/v1/files/ns/{REL}?forward={c.endpoint}"
    sent = f"/v1/files/ns/{REL}?forward={d.endpoint}"
    assert b" 403 " in head_answer(b.port, sent, signed, len(data), digest)
    assert b" 403 " in head_answer(b.port, f"/v1/files/ns/{REL}", signed, len(data), digest, data, expect=False)
    assert b.files() == {} and c.files() == {} and d.files() == {}


def test_downstream_down_keeps_the_local_copy(nodes, tmp_path: Path) -> None:
    c = nodes("c")
    c.stop()  # its port is closed now; its store dir stays for the checks
    small = nodes("small", max_file_bytes=1000)
    b = nodes("b", forward_peers={c.endpoint, small.endpoint})
    src = tmp_path / "src.bin"
    entry = make_file(src, 2 * 1024 * 1024 + 5, seed=5)
    a = client(b.endpoint)
    try:
        assert a.push_file("ns", REL, src, entry, forward=[c.endpoint]) == {c.endpoint: "queued"}
        report = settled(a, REL)
        assert set(report) == {c.endpoint} and report[c.endpoint] != "ok"
        assert "Connect" in report[c.endpoint] or "refused" in report[c.endpoint].lower()
        assert b.files() == {REL: entry}
        assert c.files() == {} and c.incoming_empty()
        # A hop that refuses the file (too big for it): named with its answer; b keeps its copy.
        a.push_file("ns", "step_000000005/two.bin", src, entry, forward=[small.endpoint])
        assert settled(a, "step_000000005/two.bin")[small.endpoint].startswith("HTTP 413")
        assert b.files() == {REL: entry, "step_000000005/two.bin": entry}
        assert small.files() == {} and small.incoming_empty()
    finally:
        a.close()


def test_cut_upload_leaves_nothing_on_any_hop(nodes) -> None:
    c = nodes("c")
    b = nodes("b", forward_peers={c.endpoint})
    data = os.urandom(3 * 1024 * 1024)
    digest = xxhash.xxh3_128_hexdigest(data)
    path = f"/v1/files/ns/{REL}?forward={c.endpoint}"
    headers = auth_headers(SECRET, "PUT", path, len(data), digest)
    head = f"PUT {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", b.port), timeout=10) as s:
        s.sendall(head.encode() + b"\r\n" + data[: len(data) // 2])
        wait_for(lambda: os.listdir(b.root / ".incoming"), 10, "the upload to reach b")
    # The sender is gone mid-body: b discards its part; a file is sent on only once stored whole.
    wait_for(lambda: b.incoming_empty() and c.incoming_empty(), 15, "both hops to drop the partial upload")
    assert b.files() == {} and c.files() == {}
    # A body that does not match its declared checksum is stored nowhere either.
    bad = bytearray(data)
    bad[-1] ^= 1
    a = client(b.endpoint)
    src = b.root.parent / "bad.bin"
    src.write_bytes(bad)
    try:
        with pytest.raises(TransportError, match="xxh3-128 mismatch"):
            a.push_file("ns", REL, src, FileEntry(len(data), digest), forward=[c.endpoint])
    finally:
        a.close()
    wait_for(lambda: b.incoming_empty() and c.incoming_empty(), 15, "both hops to drop the bad upload")
    assert b.files() == {} and c.files() == {}


# ------------------------------------------------------------ replication engine

def write_part(ckpt: Path, step: int, sizes: dict[str, int]) -> dict[str, FileEntry]:
    step_dir = ckpt / step_dir_name(step)
    files = {name: make_file(step_dir / name, size, seed=i) for i, (name, size) in enumerate(sizes.items())}
    m = RankManifest(SCHEMA_VERSION, step, 1, 0, "test", files, 1.0, extra={"node_rank": 0, "job": "job"})
    (step_dir / manifest_name(0)).write_text(m.to_json())
    return files


class Cluster:
    """Three nodes; node 0 replicates with factor 2 (targets 1 then 2) through counting relays."""

    def __init__(self, root: Path, forward_ssl: ssl.SSLContext | None = None) -> None:
        ports = free_ports(3)
        self.peers = tuple(f"127.0.0.1:{p}" for p in ports)
        self.nodes = {n: Node(root / f"replicas{n}", port=ports[n], request_timeout=5.0,
                              forward_peers=[ep for i, ep in enumerate(self.peers) if i != n],
                              own_endpoint=self.peers[n], forward_ssl=forward_ssl if n == 1 else None)
                      for n in (1, 2)}
        self.proxies = {n: CountingProxy(ports[n]) for n in (1, 2)}
        self.clients = {n: client(self.proxies[n].endpoint) for n in (1, 2)}
        self.ckpt = root / "node0" / "checkpoints"
        self.engine = ReplicationEngine(
            membership=Membership(self.peers, 0), checkpoint_dir=self.ckpt, replica_root=root / "replicas0",
            clients=self.clients, settings=ReplicationSettings(factor=2, jump=1),
            state_path=root / "node0" / "state" / "replication.json", job="job")

    def replica_valid(self, n: int, files: dict[str, FileEntry]) -> bool:
        ns_dir = self.nodes[n].root / namespace_of("job", 0)
        parts = scan_parts(ns_dir, full=True) if ns_dir.is_dir() else []
        return [(p.step, p.rank, p.manifest.files) for p in parts] == [(5, 0, files)]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for p in self.proxies.values():
            p.close()
        for n in self.nodes.values():
            n.stop()


def test_engine_chains_a_part_through_both_targets(tmp_path: Path) -> None:
    cl = Cluster(tmp_path)
    try:
        assert cl.engine.targets == [1, 2]
        files = write_part(cl.ckpt, 5, {"model.bin": 5 * 1024 * 1024 + 3, "optim.bin": 2 * 1024 * 1024})
        data = sum(e.size for e in files.values())
        cl.engine.sync()
        assert cl.replica_valid(1, files) and cl.replica_valid(2, files)
        # Every data byte left node 0 once, to node 1; node 2 got it from node 1.
        assert data <= cl.proxies[1].sent < data + 64 * 1024
        assert cl.proxies[2].sent < 64 * 1024
        assert cl.engine.progress[1].parts_sent == cl.engine.progress[2].parts_sent == 1
        sent = (cl.proxies[1].sent, cl.proxies[2].sent)
        cl.engine.sync()  # both hold it: nothing is sent again
        assert cl.proxies[1].sent - sent[0] < 16 * 1024 and cl.proxies[2].sent - sent[1] < 16 * 1024
    finally:
        cl.close()


def test_engine_copies_directly_where_the_chain_did_not_reach(tmp_path: Path) -> None:
    # Node 1 forwards over TLS to node 2, which speaks plain HTTP: the forward fails, node 1 keeps its copy.
    tls = ssl.create_default_context()
    cl = Cluster(tmp_path, forward_ssl=tls)
    try:
        files = write_part(cl.ckpt, 5, {"model.bin": 3 * 1024 * 1024})
        data = sum(e.size for e in files.values())
        cl.engine.sync()
        assert cl.replica_valid(1, files) and cl.replica_valid(2, files)
        assert data <= cl.proxies[1].sent < data + 64 * 1024
        assert data <= cl.proxies[2].sent < data + 64 * 1024  # the direct copy, in the same pass
    finally:
        cl.close()


def test_engine_with_the_middle_node_down_copies_to_the_other(tmp_path: Path) -> None:
    cl = Cluster(tmp_path)
    try:
        cl.nodes[1].stop()
        files = write_part(cl.ckpt, 5, {"model.bin": 3 * 1024 * 1024})
        cl.engine.sync()
        assert cl.replica_valid(2, files)
        assert cl.engine.progress[1].failures >= 1 and not cl.replica_valid(1, files)
    finally:
        cl.close()


def test_engine_reports_a_corrupt_source_once(tmp_path: Path) -> None:
    cl = Cluster(tmp_path)
    try:
        files = write_part(cl.ckpt, 5, {"model.bin": 1024 * 1024})
        path = cl.ckpt / step_dir_name(5) / "model.bin"
        raw = bytearray(path.read_bytes())
        raw[100] ^= 1  # same size: only the receivers' checksum can tell
        path.write_bytes(raw)
        cl.engine.sync()
        assert not cl.replica_valid(1, files) and not cl.replica_valid(2, files)
        assert "invalid" in cl.engine.progress[1].last_error
        assert cl.nodes[1].incoming_empty() and cl.nodes[2].incoming_empty()
        sent = cl.proxies[1].sent
        cl.engine.sync()  # known invalid: not sent again
        assert cl.proxies[1].sent - sent < 16 * 1024
    finally:
        cl.close()
