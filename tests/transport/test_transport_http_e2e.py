"""ReplicationServer + PeerClient over real HTTP on 127.0.0.1: transfers, hostile input, limits."""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
import xxhash

from supervisor.transport.auth import auth_headers
from supervisor.transport.client import BandwidthLimiter, PeerClient, TransferPool, TransportError
from supervisor.transport.server import ReplicationServer
from supervisor.transport.store import ReplicaStore
from rlsup_format.manifest import FileEntry, hash_file

from support.files import make_file
from support.waits import wait_for

SECRET = b"test-secret-test-secret-test-sec"


class Node:
    def __init__(self, root: Path, **kw) -> None:
        self.root = root
        self.store = ReplicaStore(root)
        self.server = ReplicationServer(self.store, SECRET, **kw)
        self.port = self.server.start()
        self.endpoint = f"127.0.0.1:{self.port}"

    def client(self, **kw) -> PeerClient:
        kw.setdefault("retries", 0)
        return PeerClient(self.endpoint, SECRET, **kw)

    def healthy(self) -> bool:
        c = self.client(timeout=5)
        try:
            return c.health()["ok"] is True
        finally:
            c.close()

    def incoming_empty(self) -> bool:
        return os.listdir(self.root / ".incoming") == []


@pytest.fixture
def node(tmp_path: Path):
    n = Node(tmp_path / "store", header_timeout=1.0, request_timeout=2.0)
    yield n
    n.server.stop()


def raw(port: int, method: str, path: str, body: bytes = b"", sign: bool = True,
        content_length: int | None = None, xxh3: str | None = None, extra: dict | None = None) -> tuple[int, bytes]:
    """A signed request sent with http.client, path exactly as given (no normalisation)."""
    headers = {}
    if sign:
        cl = content_length if content_length is not None else (len(body) if method in ("PUT", "POST") else None)
        headers = auth_headers(SECRET, method, path, cl, xxh3)
    headers.update(extra or {})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=False, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders(body or None)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# ------------------------------------------------------------ transfers

def test_roundtrip_multi_mb(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "src" / "shard.bin"
    entry = make_file(src, 12 * 1024 * 1024 + 123, seed=1)
    c = node.client()
    c.push_file("node0", "step_000000001/__0_0.distcp", src, entry)
    c.push_file("node0", "step_000000001/.metadata", src, entry)
    assert c.index("node0") == {"step_000000001/__0_0.distcp": entry, "step_000000001/.metadata": entry}
    stored = node.store.path_of("node0", "step_000000001/__0_0.distcp")
    assert hash_file(stored) == entry
    dest = tmp_path / "back" / "deep" / "shard.bin"
    assert c.fetch_file("node0", "step_000000001/__0_0.distcp", dest, entry) == entry
    assert hash_file(dest) == entry
    # Wrong expectation: refused, and dest never appears (not even partially).
    bad = tmp_path / "back" / "bad.bin"
    with pytest.raises(TransportError, match="expected size"):
        c.fetch_file("node0", "step_000000001/__0_0.distcp", bad, FileEntry(entry.size, "0" * 32))
    with pytest.raises(TransportError) as ei:
        c.fetch_file("node0", "step_000000001/missing", bad)
    assert ei.value.status == 404
    assert not bad.exists() and sorted(os.listdir(bad.parent)) == ["deep"]
    assert c.delete("node0", "step_000000001") == 2 and c.index("node0") == {}
    c.close()


def test_concurrent_pushes(node: Node, tmp_path: Path) -> None:
    files = {f"step_000000002/rank_{i:05d}.pt": make_file(tmp_path / f"f{i}", 2 * 1024 * 1024 + i, seed=i)
             for i in range(8)}
    pool = TransferPool(4)
    clients = [node.client(pool=pool), node.client(pool=pool)]
    active, peak, lock = [0], [0], threading.Lock()

    def push(item):
        i, (rel, entry) = item
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            clients[i % 2].push_file("node1", rel, tmp_path / f"f{i}", entry)
        finally:
            with lock:
                active[0] -= 1

    pool.map(push, list(enumerate(files.items())))
    pool.shutdown()
    assert peak[0] <= 4
    assert node.store.index("node1") == files
    for c in clients:
        c.close()


def test_json_routes(node: Node) -> None:
    seen = []

    def inventory(body: dict) -> dict:
        seen.append(body)
        if body.get("bad"):
            raise ValueError("bad request body")
        return {"node": 3, "echo": body}

    node.server.add_json_route("POST", "/v1/inventory", inventory)
    node.server.add_json_route("GET", "/v1/status", lambda q: {"query": q})
    with pytest.raises(ValueError):
        node.server.add_json_route("GET", "/v1/files/x", lambda q: {})
    c = node.client()
    assert c.call_json("POST", "/v1/inventory", {"steps": [1, 2]}) == {"node": 3, "echo": {"steps": [1, 2]}}
    assert c.call_json("GET", "/v1/status", {"verbose": 1}) == {"query": {"verbose": "1"}}
    with pytest.raises(TransportError) as ei:
        c.call_json("POST", "/v1/inventory", {"bad": True})
    assert ei.value.status == 400 and "bad request body" in str(ei.value)
    with pytest.raises(TransportError) as ei:
        c.call_json("GET", "/v1/nothing", None)
    assert ei.value.status == 404
    # A JSON body not matching its signed checksum is refused.
    status, _ = raw(node.port, "POST", "/v1/inventory", b'{"a": 1}', xxh3="0" * 32)
    assert status == 400
    c.close()


# ------------------------------------------------------------ hostile paths

@pytest.mark.parametrize("path", [
    "/v1/files/node0/../../../outside/x",
    "/v1/files/node0/%2e%2e/%2e%2e/outside/x",
    "/v1/files/node0/%2E%2E%2Foutside%2Fx",
    "/v1/files/node0//tmp/outside/x",
    "/v1/files/../outside/x",
    "/v1/files/.incoming/x",
    "/v1/files/node0/a\\..\\..\\x",
    "/v1/files/node0/a%00b",
    "/v1/files/node0/./x",
])
def test_traversal_refused(node: Node, tmp_path: Path, path: str) -> None:
    data = b"escaped"
    status, _ = raw(node.port, "PUT", path, data, xxh3=xxhash.xxh3_128_hexdigest(data))
    assert 400 <= status < 500, status
    status, _ = raw(node.port, "GET", path)
    assert 400 <= status < 500, status
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.read_bytes() == data]
    assert written == []
    assert node.healthy()


def test_symlink_planted_inside_store(node: Node, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"do not serve")
    (node.root / "node0").mkdir()
    os.symlink(outside, node.root / "node0" / "step_000000001")
    src = tmp_path / "payload"
    entry = make_file(src, 1000)
    c = node.client()
    with pytest.raises(TransportError) as ei:
        c.push_file("node0", "step_000000001/x", src, entry)
    assert ei.value.status == 400
    with pytest.raises(TransportError) as ei:
        c.fetch_file("node0", "step_000000001/secret", tmp_path / "got")
    assert ei.value.status in (400, 404)
    assert os.listdir(outside) == ["secret"] and not (tmp_path / "got").exists()
    c.delete("node0", "step_000000001")
    assert (outside / "secret").read_bytes() == b"do not serve"
    c.close()


# ------------------------------------------------------------ hostile bodies

def test_oversized_body_413(tmp_path: Path) -> None:
    n = Node(tmp_path / "store", max_file_bytes=1024 * 1024)
    try:
        src = tmp_path / "big"
        entry = make_file(src, 2 * 1024 * 1024)
        c = n.client()
        with pytest.raises(TransportError) as ei:
            c.push_file("node0", "big", src, entry)
        assert ei.value.status == 413
        # Without Expect: 100-continue the answer is the same, before the body is read.
        status, _ = raw(n.port, "PUT", "/v1/files/node0/big2", b"x" * 100, content_length=2 * 1024 * 1024,
                        xxh3=entry.xxh3_128)
        assert status == 413
        assert n.store.index("node0") == {} and n.healthy()
        c.close()
    finally:
        n.server.stop()


def _put_raw_socket(port: int, path: str, declared: int, body: bytes, xxh3: str) -> None:
    headers = auth_headers(SECRET, "PUT", path, declared, xxh3)
    head = f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        s.shutdown(socket.SHUT_WR)
        try:
            s.recv(4096)
        except OSError:
            pass


def test_truncated_body_keeps_existing_replica(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "v1"
    entry = make_file(src, 300_000, seed=1)
    c = node.client()
    c.push_file("node0", "step_000000001/model.pt", src, entry)
    new = os.urandom(1_000_000)
    _put_raw_socket(node.port, "/v1/files/node0/step_000000001/model.pt", len(new), new[:200_000],
                    xxhash.xxh3_128_hexdigest(new))
    _put_raw_socket(node.port, "/v1/files/node0/step_000000001/fresh.pt", len(new), new[:10],
                    xxhash.xxh3_128_hexdigest(new))
    wait_for(node.incoming_empty, 10, "the aborted uploads to be cleaned from .incoming")
    assert c.index("node0") == {"step_000000001/model.pt": entry}
    assert hash_file(node.store.path_of("node0", "step_000000001/model.pt")) == entry
    c.close()


def test_wrong_checksum_400_keeps_existing(node: Node, tmp_path: Path) -> None:
    src = tmp_path / "v1"
    entry = make_file(src, 500_000, seed=1)
    c = node.client()
    c.push_file("node0", "f", src, entry)
    other = tmp_path / "v2"
    make_file(other, 500_000, seed=2)
    with pytest.raises(TransportError) as ei:
        c.push_file("node0", "f", other, entry)  # entry claims v1's checksum
    assert ei.value.status == 400 and "mismatch" in str(ei.value)
    assert c.index("node0") == {"f": entry} and node.incoming_empty()
    # Missing checksum / Content-Length.
    status, _ = raw(node.port, "PUT", "/v1/files/node0/g", b"abc")
    assert status == 400
    status, _ = raw(node.port, "PUT", "/v1/files/node0/g", b"", content_length=None,
                    extra={"Transfer-Encoding": "chunked"}, xxh3="0" * 32)
    assert 400 <= status < 500
    c.close()


# ------------------------------------------------------------ hostile connections

def test_huge_header_refused(node: Node) -> None:
    status, _ = raw(node.port, "GET", "/v1/health", extra={"X-Junk": "a" * 20000})
    assert 400 <= status < 500
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:
        s.sendall(b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        line = s.recv(100).split(b"\r\n")[0]
        assert line.startswith(b"HTTP/1.") and line.split()[1].startswith(b"4"), line
    assert node.healthy()


def test_slowloris_and_garbage_do_not_stop_server(node: Node) -> None:
    slow = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", node.port), timeout=5)
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-A: ")
        slow.append(s)
    garbage = []
    for i in range(5):
        s = socket.create_connection(("127.0.0.1", node.port), timeout=5)
        s.sendall(os.urandom(4096) if i else b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(500))
        garbage.append(s)
    t0 = time.monotonic()
    assert node.healthy()
    assert time.monotonic() - t0 < 2
    for s in slow[:5]:
        s.sendall(b"b")  # trickling bytes does not extend the header deadline

    def closed(s: socket.socket) -> bool:
        try:
            s.settimeout(0.2)
            data = s.recv(65536)
            return data == b"" or data.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4"))
        except TimeoutError:
            return False
        except OSError:
            return True

    for s in slow + garbage:
        wait_for(lambda: closed(s), 10, "the server to drop a stalled or garbage connection")
        s.close()
    assert node.healthy()


def test_stalled_body_times_out(node: Node) -> None:
    data = os.urandom(100_000)
    path = "/v1/files/node0/stalled"
    headers = auth_headers(SECRET, "PUT", path, len(data), xxhash.xxh3_128_hexdigest(data))
    head = f"PUT {path} HTTP/1.1\r\nHost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as s:
        s.sendall(head.encode() + b"\r\n" + data[:1000])
        s.settimeout(10)
        answer = s.recv(4096)  # request_timeout=2: the server gives up on the body
    assert b" 408 " in answer.split(b"\r\n")[0]
    wait_for(node.incoming_empty, 10, "the stalled upload to be cleaned")
    assert node.store.index("node0") == {} and node.healthy()


# ------------------------------------------------------------ failures and limits

def test_dead_peer_fails_after_retries(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens here
    src = tmp_path / "f"
    entry = make_file(src, 1000)
    c = PeerClient(f"127.0.0.1:{port}", SECRET, timeout=2, retries=2, backoff=0.1)
    t0 = time.monotonic()
    with pytest.raises(TransportError) as ei:
        c.push_file("node0", "f", src, entry)
    elapsed = time.monotonic() - t0
    assert ei.value.peer == f"127.0.0.1:{port}" and "after 3 attempts" in str(ei.value)
    assert 0.2 <= elapsed < 5, elapsed  # two backoffs (0.1 + 0.2, +-20%), then give up
    with pytest.raises(TransportError):
        c.health()
    c.close()


def test_4xx_not_retried(node: Node) -> None:
    c = PeerClient(node.endpoint, b"wrong-secret-wrong-secret-wrong!", retries=3, backoff=1.0)
    t0 = time.monotonic()
    with pytest.raises(TransportError) as ei:
        c.health()
    assert ei.value.status == 403 and time.monotonic() - t0 < 0.9
    c.close()


def test_bandwidth_limiter_caps_rate(node: Node, tmp_path: Path) -> None:
    rate, burst = 2_000_000, 256 * 1024
    limiter = BandwidthLimiter(rate, burst=burst)
    files = [make_file(tmp_path / f"f{i}", 1_500_000, seed=i) for i in range(2)]
    clients = [node.client(limiter=limiter), node.client(limiter=limiter)]  # shared: a process-wide cap
    t0 = time.monotonic()
    threads = [threading.Thread(target=clients[i].push_file, args=("n", f"f{i}", tmp_path / f"f{i}", files[i]))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    elapsed = time.monotonic() - t0
    total = sum(e.size for e in files)
    minimum = (total - burst) / rate
    assert elapsed >= 0.8 * minimum, (elapsed, minimum)
    assert len(node.store.index("n")) == 2
    # Unlimited limiter never waits.
    free = BandwidthLimiter(0)
    t0 = time.monotonic()
    free.consume(10**12)
    assert time.monotonic() - t0 < 0.1
    for c in clients:
        c.close()


# ------------------------------------------------------------ TLS

@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")
def test_tls(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    n = Node(tmp_path / "store", ssl_context=server_ctx)
    try:
        src = tmp_path / "f"
        entry = make_file(src, 3 * 1024 * 1024)
        c = PeerClient(n.endpoint, SECRET, ssl_context=client_ctx, retries=0)
        c.push_file("node0", "f", src, entry)
        assert c.fetch_file("node0", "f", tmp_path / "g") == entry
        c.close()
        plain = n.client()  # plain HTTP to a TLS port fails cleanly
        with pytest.raises(TransportError):
            plain.health()
        plain.close()
    finally:
        n.server.stop()


# ------------------------------------------------------------ overall deadlines (issue #9)

class TricklePeer:
    """A real aiohttp server on 127.0.0.1 whose every answer (a file, or an index) arrives one byte
    every ``interval`` seconds: it never stalls long enough for a per-read timeout to fire."""

    def __init__(self, content: bytes, interval: float = 0.2) -> None:
        import asyncio

        from aiohttp import web

        self.content = content
        self.interval = interval
        self.requests: list[str] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def trickle(request: web.Request, body: bytes, ctype: str) -> web.StreamResponse:
            self.requests.append(request.path)
            resp = web.StreamResponse(status=200, headers={
                "Content-Type": ctype, "X-Rlsup-Xxh3": xxhash.xxh3_128_hexdigest(body)})
            resp.content_length = len(body)
            await resp.prepare(request)
            for i in range(len(body)):
                await asyncio.sleep(self.interval)
                await resp.write(body[i:i + 1])
            return resp

        async def files(request: web.Request) -> web.StreamResponse:
            return await trickle(request, self.content, "application/octet-stream")

        async def index(request: web.Request) -> web.StreamResponse:
            body = b'{"files": {}}' + b" " * 200  # valid JSON, slowly
            return await trickle(request, body, "application/json")

        async def setup() -> None:
            app = web.Application()
            app.router.add_get("/v1/files/{tail:.*}", files)
            app.router.add_get("/v1/index/{ns}", index)
            self.runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = self.runner.addresses[0][1]

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(setup())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True, name="trickle-peer")
        self.thread.start()
        assert ready.wait(10)
        self.endpoint = f"127.0.0.1:{self.port}"

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _bounded(fn, seconds: float):
    """Run ``fn`` in a thread; the test fails (instead of hanging) if it has not returned in ``seconds``."""
    out: dict = {}

    def work() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds}s: no overall deadline"
    return out


@pytest.mark.timeout(120)
def test_trickling_peer_hits_overall_deadline(tmp_path: Path) -> None:
    content = os.urandom(2000)
    entry = FileEntry(len(content), xxhash.xxh3_128_hexdigest(content))
    peer = TricklePeer(content, interval=0.2)  # 5 B/s: the whole file would take 400 s
    try:
        # timeout=2 bounds stalls only (a byte comes every 0.2 s); the deadline is 1 s + 2000 B / 1000 B/s.
        c = PeerClient(peer.endpoint, SECRET, timeout=2, retries=2, backoff=0.05, min_throughput=1000,
                       deadline_base=1.0)
        dest = tmp_path / "step_000000003" / "rank_00002.pt"
        out = _bounded(lambda: c.fetch_file("node2", "step_000000003/rank_00002.pt", dest, entry), 30)
        err = out.get("error")
        assert isinstance(err, TransportError), out
        assert err.peer == peer.endpoint and "step_000000003/rank_00002.pt" in str(err)
        assert "overall deadline" in str(err) and peer.endpoint in str(err)
        assert peer.requests == ["/v1/files/node2/step_000000003/rank_00002.pt"]  # not retried
        assert not dest.exists() and os.listdir(dest.parent) == []  # the partial temp file is gone

        # Without an entry the deadline follows the declared Content-Length: the same answer.
        out = _bounded(lambda: c.fetch_file("node2", "step_000000003/rank_00002.pt", dest), 30)
        assert isinstance(out.get("error"), TransportError) and "overall deadline" in str(out["error"])
        assert os.listdir(dest.parent) == []

        # An index (a small JSON request) has its own overall deadline.
        out = _bounded(lambda: c.index("node2"), 30)
        err = out.get("error")
        assert isinstance(err, TransportError) and "overall deadline" in str(err), out
        assert "/v1/index/node2" in str(err) and err.peer == peer.endpoint
        c.close()
    finally:
        peer.close()


@pytest.mark.timeout(120)
def test_deadline_does_not_count_our_own_bandwidth_cap(tmp_path: Path) -> None:
    # 300 KB through a 100 KB/s limiter takes ~2.7 s, far beyond 1 s + 300 KB at 1 MB/s; the time spent
    # waiting for our own limiter is not the peer's slowness, so both directions must succeed. (A server
    # with default timeouts: the limiter holds the one 300 KB chunk longer than the fixture's 2 s.)
    node = Node(tmp_path / "store")
    try:
        src = tmp_path / "src.bin"
        entry = make_file(src, 300_000, seed=5)
        limiter = BandwidthLimiter(100_000, burst=32 * 1024)
        c = node.client(limiter=limiter, min_throughput=1_000_000, deadline_base=1.0)
        t0 = time.monotonic()
        c.push_file("node0", "step_000000001/rank_00000.pt", src, entry)
        assert c.fetch_file("node0", "step_000000001/rank_00000.pt", tmp_path / "back.bin", entry) == entry
        assert time.monotonic() - t0 > 2.0  # the limiter did hold both transfers beyond the bare deadline
        assert hash_file(tmp_path / "back.bin") == entry
        c.close()
    finally:
        node.server.stop()


def test_push_refuses_symlinked_source(node: Node, tmp_path: Path) -> None:
    real = tmp_path / "real.bin"
    entry = make_file(real, 1000)
    link = tmp_path / "rank_00000.pt"
    os.symlink(real, link)
    c = node.client()
    with pytest.raises(TransportError, match="symbolic link"):
        c.push_file("node0", "step_000000001/rank_00000.pt", link, entry)
    from supervisor.transport.store import InvalidPath

    with pytest.raises(InvalidPath, match="symbolic link"):  # nor copied into a store locally
        node.store.put_file("node0", "step_000000001/rank_00000.pt", link, entry)
    assert node.store.index("node0") == {} and node.incoming_empty()
    c.close()


# ------------------------------------------------------------ JSON calls on the one I/O stack (issue 29)

class CannedPeer:
    """A TCP server on 127.0.0.1 that reads each request head (and its declared body) and answers with
    the next of ``answers`` (raw bytes; the last one repeats), closing the connection after each."""

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = answers
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body) as received
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True, name="canned-peer")
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                buf = b""
                while b"\r\n\r\n" not in buf and (chunk := conn.recv(65536)):
                    buf += chunk
                head, _, body = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length and (chunk := conn.recv(65536)):
                    body += chunk
                self.requests.append((head, body))
                conn.sendall(self.answers[min(len(self.requests), len(self.answers)) - 1])

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (a close alone does not)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(10)
        assert not self.thread.is_alive()


def _answer(body: bytes, status: str = "200 OK", headers: str | None = None) -> bytes:
    head = headers if headers is not None else f"Content-Length: {len(body)}\r\n"
    return f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{head}\r\n".encode() + body


@pytest.mark.parametrize("answer, says", [
    (_answer(b'{"files": '), "invalid JSON answer"),
    (_answer(b'["not", "an", "object"]'), "answer is not a JSON object"),
    (_answer(b"{}", headers=f"Content-Length: {(64 << 20) + 1}\r\n"), "exceeds"),
    (_answer(b"2\r\n{}\r\n0\r\n\r\n", headers="Transfer-Encoding: chunked\r\n"), "chunked answer"),
    (_answer(b"{}", headers=""), "lacks a valid Content-Length"),
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "malformed status line"),
], ids=["invalid-json", "not-an-object", "oversized", "chunked", "no-length", "not-http"])
def test_malformed_or_oversized_json_answer_refused(answer: bytes, says: str) -> None:
    peer = CannedPeer([answer])
    try:
        c = PeerClient(peer.endpoint, SECRET, timeout=5, retries=2, backoff=0.01)
        with pytest.raises(TransportError, match=says) as ei:
            c.index("node0")
        assert ei.value.peer == peer.endpoint and "/v1/index/node0" in str(ei.value)
        # A peer that breaks the protocol is not asked again; a garbled status line may be the network's.
        assert len(peer.requests) == (3 if says == "malformed status line" else 1)
    finally:
        peer.close()


def test_json_5xx_retried_then_answered() -> None:
    peer = CannedPeer([_answer(b'{"error": "busy"}', "503 Service Unavailable"), _answer(b'{"ok": true}')])
    try:
        c = PeerClient(peer.endpoint, SECRET, timeout=5, retries=2, backoff=0.01)
        assert c.health() == {"ok": True}
        assert len(peer.requests) == 2
        # Out of retries: the last error, its status and the number of attempts.
        peer.answers = [_answer(b'{"error": "disk full"}', "507 Insufficient Storage")]
        with pytest.raises(TransportError, match=r"HTTP 507: disk full \(gave up after 3 attempts\)") as ei:
            c.health()
        assert ei.value.status == 507
    finally:
        peer.close()


def test_every_json_request_signed_as_the_server_verifies() -> None:
    from supervisor.transport.auth import Verifier

    peer = CannedPeer([_answer(b'{"removed": 2}')])
    try:
        c = PeerClient(peer.endpoint, SECRET, retries=0)
        c.call_json("POST", "/v1/inventory", {"step": 3})
        c.call_json("POST", "/v1/ping")  # no body: Content-Length 0, signed
        c.call_json("GET", "/v1/status", {"verbose": 1})  # the query string is in the signature
        assert c.delete("node0", "step_000000001") == 2
        verifier = Verifier(SECRET)
        for head, body in peer.requests:
            line, *fields = head.decode("latin-1").split("\r\n")
            method, target, _ = line.split(" ")
            headers = dict(f.split(": ", 1) for f in fields)
            assert verifier.verify(method, target, headers).ok, head
            assert int(headers.get("Content-Length", "0")) == len(body)
        assert [h.split(b"\r\n")[0] for h, _ in peer.requests] == [
            b"POST /v1/inventory HTTP/1.1", b"POST /v1/ping HTTP/1.1", b"GET /v1/status?verbose=1 HTTP/1.1",
            b"DELETE /v1/files/node0/step_000000001 HTTP/1.1"]
        assert peer.requests[0][1] == b'{"step": 3}'
    finally:
        peer.close()
