"""The etcd gateway client (supervisor.cluster.etcd_http, supervisor.cluster.etcd_watch) against a scripted HTTP server on a
real socket: answers the gateway never writes (no length, junk chunks, oversized headers or messages, a
stream cut short, JSON that is not a watch message) are refused with a clear error and never taken as
"no change"; a message split over two writes, with a read timing out between them, is still read whole."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Iterator

import pytest

from supervisor.cluster import etcd_http
from supervisor.cluster.etcd_watch import EtcdWatch, WatchBroken
from supervisor.cluster.kvstore import StoreUnavailable
from supervisor.cluster.kvstore_etcd import EtcdKVStore

STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _message(obj: object) -> bytes:
    return _chunk(json.dumps(obj).encode() + b"\n")


class ScriptedServer:
    """Accepts connections; on each request (head and Content-Length body read) writes ``parts`` in order
    (None: close the connection there), waiting for ``gate`` before each part after the first when ``gate``
    is given; then keeps the socket open until the test ends (a stream neither ended nor answered further)."""

    def __init__(self, parts: list[bytes | None], gate: threading.Event | None = None) -> None:
        self.parts, self.gate = parts, gate
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[bytes] = []
        self.done = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        self.requests.append(head.split(b"\r\n")[0] + b" " + body)
        for i, part in enumerate(self.parts):
            if i and self.gate is not None:
                self.gate.wait(30)
            try:
                if part is None:
                    conn.close()
                    return
                conn.sendall(part)
            except OSError:
                return
        self.done.wait(60)

    def close(self) -> None:
        self.done.set()
        self.listener.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def serve() -> Iterator:
    servers: list[ScriptedServer] = []

    def make(parts: list[bytes | None], gate: threading.Event | None = None) -> ScriptedServer:
        servers.append(ScriptedServer(parts, gate))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _soon() -> float:
    return time.monotonic() + 5.0


def test_a_plain_answer_is_read(serve) -> None:
    server = serve([b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{\"a\": \"b\"}\n"])
    conn = etcd_http.Connection("127.0.0.1", server.port)
    assert conn.post("/v3/kv/range", b'{"key":"YQ=="}', _soon()) == etcd_http.Response(200, b'{"a": "b"}\n')
    assert conn.is_open  # kept alive
    assert server.requests == [b'POST /v3/kv/range HTTP/1.1 {"key":"YQ=="}']
    conn.close()


@pytest.mark.parametrize("answer, why", [
    (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{}", "lacks a valid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n{}" % (etcd_http.MAX_BODY_BYTES + 1), "exceeds the limit"),
    (b"SPDY/3 200 OK\r\nContent-Length: 2\r\n\r\n{}", "malformed status line"),
    (b"HTTP/1.1 200 OK\r\nX-Junk: " + b"j" * (etcd_http.MAX_HEAD_BYTES + 10), "headers over"),
    (b"HTTP/1.1 200 OK\r\nContent-Type\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size that does not parse"),
])
def test_answers_the_gateway_never_writes_are_refused(serve, answer: bytes, why: str) -> None:
    conn = etcd_http.Connection("127.0.0.1", serve([answer]).port)
    with pytest.raises(etcd_http.BadResponse, match=why):
        conn.post("/v3/kv/range", b"{}", _soon())
    assert not conn.is_open


def test_an_answer_cut_short_is_closed_not_partial(serve) -> None:
    conn = etcd_http.Connection("127.0.0.1", serve([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial", None]).port)
    with pytest.raises(etcd_http.Closed, match="closed"):
        conn.post("/v3/kv/range", b"{}", _soon())
    assert not conn.is_open


def test_no_answer_in_time_is_timed_out(serve) -> None:
    conn = etcd_http.Connection("127.0.0.1", serve([b"HTTP/1.1 200 OK\r\n"]).port)
    with pytest.raises(etcd_http.TimedOut):
        conn.post("/v3/kv/range", b"{}", time.monotonic() + 0.2)
    assert not conn.is_open  # its answer may still come: the connection is not reused


def test_nothing_listening_is_connect_failed() -> None:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(etcd_http.ConnectFailed):
        etcd_http.Connection("127.0.0.1", port).post("/v3/kv/range", b"{}", _soon())


def _watch(server: ScriptedServer, limit: int = 1 << 20) -> EtcdWatch:
    conn = etcd_http.Connection("127.0.0.1", server.port)
    return EtcdWatch(conn, frozenset({"k"}), [(b"k", None)], 5, limit).open(_soon())


def test_a_watch_reports_events_and_keeps_their_values(serve) -> None:
    event = {"result": {"events": [{"kv": {"key": "aw==", "value": "dg=="}}]}}  # k = v
    server = serve([STREAM_HEAD + _message({"result": {"created": True}}) + _message(event)])
    watch = _watch(server)
    assert watch.changed(_soon()) is True
    assert watch.values == {"k": b"v"}
    assert json.loads(server.requests[0].partition(b" HTTP/1.1 ")[2]) == {
        "create_request": {"key": "aw==", "start_revision": 5}}
    assert watch.changed(time.monotonic() + 0.05) is False  # nothing more came
    watch.close()


def test_a_message_split_over_a_read_timeout_is_read_whole(serve) -> None:
    event = _message({"result": {"events": [{"kv": {"key": "aw==", "value": "dg=="}}]}})
    gate = threading.Event()
    watch = _watch(serve([STREAM_HEAD + event[:25], event[25:]], gate))
    assert watch.changed(time.monotonic() + 0.05) is False  # half a chunk: no message yet, nothing lost
    gate.set()
    assert watch.changed(_soon()) is True
    assert watch.values == {"k": b"v"}
    watch.close()


@pytest.mark.parametrize("stream, why", [
    (STREAM_HEAD + _chunk(b"not json\n"), "not JSON"),
    (STREAM_HEAD + _message({"error": {"grpc_code": 14, "message": "transport is closing"}}), "transport is closing"),
    (STREAM_HEAD + _message({"result": {"canceled": True, "compact_revision": "9"}}), "canceled"),
    (STREAM_HEAD + _message({"result": {"events": [{"kv": {"key": "%%%"}}]}}), "does not parse"),
    (STREAM_HEAD + _message({"result": {"events": [{"kv": {"key": "aw==", "value": "v" * 2000}}]}}), "over"),
    (STREAM_HEAD + b"a\r\n" + b"x" * 10 + b"junk", "not followed by CRLF"),
    (STREAM_HEAD + b"0\r\n\r\n", "ended the stream"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", "not chunked"),
    (b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}", "HTTP 404"),
])
def test_a_watch_that_breaks_says_so(serve, stream: bytes, why: str) -> None:
    server = serve([stream])
    with pytest.raises(WatchBroken, match=why):
        _watch(server, limit=1024).changed(_soon())


def test_the_store_refuses_an_answer_that_is_not_json(serve) -> None:
    body = b"<html>a proxy's error page</html>"
    server = serve([b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)])
    store = EtcdKVStore([f"127.0.0.1:{server.port}"], timeout_s=0.5)
    with pytest.raises(StoreUnavailable, match="not JSON"):
        store.get("k")
    store.close()


def test_the_store_names_what_etcd_refused(serve) -> None:
    body = json.dumps({"error": "etcdserver: too many operations in txn request", "code": 3}).encode()
    server = serve([b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)])
    store = EtcdKVStore([f"127.0.0.1:{server.port}"], timeout_s=5.0)
    with pytest.raises(StoreUnavailable, match="rejected by .*too many operations"):
        store.get("k")
    store.close()
