"""Hostile network actors: a peer that lies, stalls or drops (speaking just enough HTTP/1.1), and a
client that throws garbage at the replication endpoint. Used by the transport chaos scenarios."""

from __future__ import annotations

import random
import socket
import threading
import time

import xxhash

PEER_MODES = ("wrong_bytes", "stall_mid_body", "drop_mid_body", "short_body", "garbage_response",
              "wrong_checksum_header", "huge_length", "slow_drip", "no_answer", "index_lies")


class HostilePeer:
    """A TCP server on 127.0.0.1 answering every request according to ``mode``; ``content`` is the true
    file, whose real size and xxh3 it advertises where the mode calls for it."""

    def __init__(self, mode: str, content: bytes, seed: int = 0) -> None:
        self.mode = mode
        self.content = content
        self.rng = random.Random(seed)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self.requests = 0
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True, name=f"hostile-{mode}").start()

    def close(self) -> None:
        self._stop.set()
        for c in [self.sock, *self._conns]:
            try:
                c.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _read_head(self, conn: socket.socket) -> bytes:
        buf = b""
        conn.settimeout(10)
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            buf += chunk
        return buf.split(b"\r\n", 1)[0]

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                line = self._read_head(conn)
                if not line:
                    return
                self.requests += 1
                if not self._answer(conn, line.decode("latin-1")):
                    return
        except OSError:
            return
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def _answer(self, conn: socket.socket, line: str) -> bool:
        data = self.content
        digest = xxhash.xxh3_128_hexdigest(data)
        mode = self.mode

        def head(length: int, xxh3: str = digest, ctype: str = "application/octet-stream") -> bytes:
            return (f"HTTP/1.1 200 OK\r\nContent-Length: {length}\r\nX-Rlsup-Xxh3: {xxh3}\r\n"
                    f"Content-Type: {ctype}\r\n\r\n").encode()

        if "/v1/index/" in line:
            if mode == "index_lies":
                body = b'{"files": {"step_000000001/../../x": {"size": "many", "xxh3_128": 7}, "a": null}}'
            else:
                body = b'{"files": {}}'
            conn.sendall(head(len(body), xxhash.xxh3_128_hexdigest(body), "application/json") + body)
            return True
        if mode == "wrong_bytes":
            bad = bytearray(data)
            bad[self.rng.randrange(len(bad))] ^= 0x01
            conn.sendall(head(len(data)) + bytes(bad))
            return True
        if mode == "wrong_checksum_header":
            conn.sendall(head(len(data), "0" * 32) + data)
            return True
        if mode == "stall_mid_body":
            conn.sendall(head(len(data)) + data[: len(data) // 2])
            self._stop.wait(120)  # never finishes; the client must give up on its own
            return False
        if mode == "drop_mid_body":
            conn.sendall(head(len(data)) + data[: len(data) // 3])
            conn.shutdown(socket.SHUT_RDWR)
            return False
        if mode == "short_body":
            conn.sendall(head(len(data) + 1000) + data)
            conn.shutdown(socket.SHUT_RDWR)
            return False
        if mode == "huge_length":
            conn.sendall(head(1 << 50) + data[:1000])
            conn.shutdown(socket.SHUT_RDWR)
            return False
        if mode == "garbage_response":
            conn.sendall(bytes(self.rng.randrange(256) for _ in range(4096)))
            conn.shutdown(socket.SHUT_RDWR)
            return False
        if mode == "slow_drip":
            conn.sendall(head(len(data)))
            for i in range(0, len(data), 64):
                if self._stop.wait(1.0):
                    return False
                conn.sendall(data[i:i + 64])  # 64 B/s: never stalls long enough, never ends in time
            return True
        if mode == "no_answer":
            self._stop.wait(120)
            return False
        raise ValueError(mode)


# ------------------------------------------------------------------ hostile client payloads


def hostile_requests(rng: random.Random, signed) -> list[tuple[str, bytes, float]]:
    """(label, raw bytes to send, seconds to drip them over) for a barrage against the server.
    ``signed(method, path, body)`` builds a correctly signed request (to probe authorisation bypasses)."""
    out: list[tuple[str, bytes, float]] = []
    req = lambda m, p, h="", b=b"": f"{m} {p} HTTP/1.1\r\nHost: x\r\n{h}\r\n".encode() + b  # noqa: E731
    out.append(("no auth GET index", req("GET", "/v1/index/node0"), 0))
    out.append(("no auth PUT", req("PUT", "/v1/files/node0/step_000000001/x", "Content-Length: 3\r\n", b"abc"), 0))
    out.append(("bad auth", req("GET", "/v1/health", "Authorization: RLSUP-HMAC-SHA256 " + "0" * 64 + "\r\n"
                                "X-Rlsup-Timestamp: 1\r\nX-Rlsup-Nonce: aaaaaaaaaaaaaaaaaaaa\r\n"), 0))
    out.append(("wrong scheme", req("GET", "/v1/health", "Authorization: Basic YWRtaW46YWRtaW4=\r\n"), 0))
    for path in ("/v1/files/node0/../../../etc/passwd", "/v1/files/node0/%2e%2e/%2e%2e/etc/passwd",
                 "/v1/files/../x", "/v1/files/node0//etc/passwd", "/v1/files/.incoming/x", "/v1/files/.meta/node0.json",
                 "/v1/index/..", "/v1/files/node0/step_1/..%2fx", "/v1/files/node0/a\\..\\b",
                 "//etc/passwd", "/v1/files/node0/" + "a/" * 40 + "b"):
        out.append((f"traversal signed GET {path}", signed("GET", path, b""), 0))
        out.append((f"traversal signed PUT {path}", signed("PUT", path, b"evil"), 0))
    out.append(("huge header", req("GET", "/v1/health", "X-Big: " + "a" * 200_000 + "\r\n"), 0))
    out.append(("many headers", req("GET", "/v1/health", "".join(f"X-H{i}: v\r\n" for i in range(500))), 0))
    out.append(("huge request line", req("GET", "/v1/" + "a" * 100_000), 0))
    out.append(("slowloris", b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-a: b", 3.0))
    out.append(("declared 1 TB upload", signed("PUT", "/v1/files/node0/big", b"", declare=1 << 40), 0))
    out.append(("chunked upload", req("PUT", "/v1/files/node0/c", "Transfer-Encoding: chunked\r\n", b"5\r\nhello\r\n0\r\n\r\n"), 0))
    for i in range(6):
        n = rng.randint(1, 8192)
        out.append((f"random bytes #{i}", bytes(rng.randrange(256) for _ in range(n)), 0))
    out.append(("http/0.9", b"GET /\r\n", 0))
    out.append(("null bytes", b"\x00" * 1024, 0))
    out.append(("half request then close", b"PUT /v1/files/node0/x HTTP/1.1\r\nContent-Length: 100\r\n\r\nabc", 0))
    return out


def send_raw(port: int, data: bytes, drip_s: float = 0.0, read_timeout: float = 10.0) -> bytes:
    """Send ``data`` (dripped over ``drip_s``), return whatever comes back until close or timeout."""
    s = socket.create_connection(("127.0.0.1", port), timeout=read_timeout)
    try:
        if drip_s:
            step = max(1, len(data) // 20)
            try:
                for i in range(0, len(data), step):
                    s.sendall(data[i:i + step])
                    time.sleep(drip_s / 20)
            except OSError:
                pass  # the server hung up on the slow client: what we want
        else:
            try:
                s.sendall(data)
            except OSError:
                pass
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
                if b"\r\n\r\n" in out:
                    break  # a response head is all we judge
        except (socket.timeout, OSError):
            pass
        return out
    finally:
        s.close()
