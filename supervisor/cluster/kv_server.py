"""The embedded coordination store's host: node 0's supervisor keeps the job's keys in a table and serves it to the
other nodes over :mod:`supervisor.cluster.kv_wire`.

One daemon thread accepts, one serves each connection; nothing here runs on the run loop's thread, and a client
that stops answering holds only its own thread (TCP keepalive ends a vanished one). A connection must finish its
handshake within :data:`HANDSHAKE_S`; at most :data:`MAX_CONNECTIONS` are served at once, of which at most
:data:`MAX_HANDSHAKING` unauthenticated.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Sequence

from supervisor.cluster.kv_wire import Session, WireError, server_handshake

log = logging.getLogger(__name__)

HANDSHAKE_S = 5.0  # the whole handshake's deadline (not one read's)
MAX_CONNECTIONS = 512
MAX_HANDSHAKING = 32  # connections not yet authenticated, at most: strangers never take an authenticated node's slot
MAX_WAIT_S = 1.0  # the longest one wait request is held (a client's wait asks for its poll interval, 2-50 ms)
KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 6}  # a vanished client's thread ends in ~90 s


class KVTable:
    """The keys, behind one lock. Every operation is immediate except :meth:`wait`, which a node's wait calls
    between its polls: it returns as soon as a key it watches is written (no sleep to the next poll), and says
    when none was (the next poll is skipped). Writes are numbered for it."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._written_at: dict[str, int] = {}  # key -> the number of its last write
        self._seq = 0
        self._lock = threading.Condition()

    def _write(self, key: str, value: bytes) -> None:
        """Under the lock: store, number the write, wake the waits."""
        self._seq += 1
        self._values[key] = bytes(value)
        self._written_at[key] = self._seq
        self._lock.notify_all()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._write(key, value)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            return [self._values.get(k) for k in keys]

    def poll(self, keys: Sequence[str], other: str | None) -> tuple[list[bytes] | None, bytes | None, int]:
        """:meth:`~supervisor.cluster.kvstore.KVStore.poll`, and the number of the last write it saw (for
        :meth:`wait`)."""
        with self._lock:
            if all(k in self._values for k in keys):
                return [self._values[k] for k in keys], None, self._seq
            return None, self._values.get(other) if other is not None else None, self._seq

    def wait(self, keys: Sequence[str], since: int, timeout: float) -> bool:
        """Up to ``timeout`` (at most :data:`MAX_WAIT_S`) for one of ``keys`` to be written after write ``since``;
        whether one was."""
        deadline = time.monotonic() + min(timeout, MAX_WAIT_S)
        with self._lock:
            while not any(self._written_at.get(k, 0) > since for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def create(self, key: str, value: bytes) -> bytes:
        with self._lock:
            if key not in self._values:
                self._write(key, value)
            return self._values[key]

    def add(self, key: str, amount: int) -> int:
        """The counter is kept as decimal text (any client reads it with :meth:`get_many`)."""
        with self._lock:
            raw = self._values.get(key, b"0")
            try:
                total = int(raw) + amount
            except ValueError:
                raise ValueError(f"key {key!r} does not hold a counter") from None
            self._write(key, str(total).encode())
            return total

    def delete(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                self._values.pop(k, None)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """One request from the wire (``[op, args...]``) answered: ``[b"ok", results...]`` or ``[b"err", why]``;
        a request that does not parse or cannot be done is an ``err``, never the end of the connection."""
        try:
            return [b"ok", *self._dispatch(request[0], request[1:])]
        except Exception as e:  # noqa: BLE001 - malformed input (ValueError, IndexError, OverflowError ...): say so
            return [b"err", f"{type(e).__name__}: {e}".encode()[:1024]]

    def _dispatch(self, op: bytes, args: list[bytes]) -> list[bytes]:
        if op == b"set" and len(args) == 2:
            self.set(args[0].decode(), args[1])
            return []
        if op == b"get":
            return [f for v in self.get_many([a.decode() for a in args]) for f in _optional(v)]
        if op == b"poll" and args:
            other = args[0].decode() if args[0] else None
            values, other_value, seq = self.poll([a.decode() for a in args[1:]], other)
            return [str(seq).encode(), *([b"1", *values] if values is not None else [b"0", *_optional(other_value)])]
        if op == b"wait" and len(args) >= 2:
            changed = self.wait([a.decode() for a in args[2:]], int(args[0]), int(args[1]) / 1000)
            return [b"1" if changed else b"0"]
        if op == b"create" and len(args) == 2:
            return [self.create(args[0].decode(), args[1])]
        if op == b"add" and len(args) == 2:
            return [str(self.add(args[0].decode(), int(args[1]))).encode()]
        if op == b"delete":
            self.delete([a.decode() for a in args])
            return []
        raise ValueError(f"unknown request {op[:32]!r} with {len(args)} arguments")


def _optional(value: bytes | None) -> list[bytes]:
    return [b"0", b""] if value is None else [b"1", value]


class KVServer:
    """Serves ``table`` on ``port`` (every interface, as torchrun's store does) to clients holding ``secret``;
    ``serves`` (the job's id and source) is said in the hello so a node of another job can name it.
    :class:`OSError` when the port is taken."""

    def __init__(self, port: int, secret: bytes, serves: dict, table: KVTable) -> None:
        self.table, self._secret, self._serves = table, secret, serves
        dual = socket.has_dualstack_ipv6()
        self._listener = socket.create_server(("", port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                              backlog=128, dualstack_ipv6=dual)
        self._conns: set[socket.socket] = set()
        self._handshaking = 0
        self._lock = threading.Lock()
        self._closed = False
        self.cpu_s = 0.0  # CPU its connections' threads spent answering (the scale benchmark reports it)
        threading.Thread(target=self._accept, name=f"rlsup-kv-accept-{port}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError as e:
                if self._closed:
                    return
                log.warning("coordination store: accept failed (%s); accepting again", e)  # EMFILE, ENOBUFS ...
                time.sleep(0.1)
                continue
            with self._lock:
                if self._closed or len(self._conns) >= MAX_CONNECTIONS or self._handshaking >= MAX_HANDSHAKING:
                    conn.close()
                    continue
                self._conns.add(conn)
                self._handshaking += 1
            threading.Thread(target=self._serve, args=(conn,), name="rlsup-kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        shaking = True
        try:
            _keepalive(conn)
            session: Session = server_handshake(conn, self._secret, self._serves, time.monotonic() + HANDSHAKE_S)
            with self._lock:
                self._handshaking, shaking = self._handshaking - 1, False
            conn.settimeout(None)  # a node between rounds is idle for as long as an attempt runs
            while True:
                request = session.receive()
                start = time.thread_time()
                answer = self.table.answer(request)
                try:
                    session.send(answer)
                except ValueError as e:  # over the frame limit: nothing was sent
                    session.send([b"err", str(e).encode()])
                self.cpu_s += time.thread_time() - start  # a race may lose an addition: a figure, not a count
        except (OSError, WireError) as e:
            log.debug("coordination store: a connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._handshaking -= shaking
            conn.close()

    def close(self) -> None:
        """Stop serving: the listener and every connection (their clients fail at once, as when node 0 dies)."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for s in (self._listener, *conns):
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept or recv
            except OSError:
                pass
            s.close()


def _keepalive(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
