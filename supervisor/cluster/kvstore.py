"""The key-value store the node supervisors agree through, behind one small interface.

Two stores sit behind it: the embedded one (hosted by node 0's supervisor, as torchrun's c10d rendezvous hosts
its own ``TCPStore``; rlsup's own authenticated protocol, :mod:`supervisor.cluster.kv_wire`) and etcd v3
(:mod:`supervisor.cluster.kvstore_etcd`), a highly available store whose loss of one member or of any one node stalls nobody. The coordinator
(:mod:`supervisor.cluster.coordinator`) signs and namespaces what it writes; a store only moves bytes.

Semantics every store keeps: keys are never rewritten by the protocol except through :meth:`set`;
:meth:`create` is atomic (the first writer wins, everyone reads the winner); :meth:`get` never blocks.
A store that cannot be reached raises :class:`StoreUnavailable`, within :data:`OP_TIMEOUT_S` even when its
host is cut off and TCP neither answers nor resets.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, NoReturn, Protocol, Sequence

from supervisor.cluster.kv_wire import Refused, Session, WireError, client_handshake

if TYPE_CHECKING:
    from supervisor.stop_request import StopRequest

#: The longest one operation of the embedded store may take. Every operation is immediate (a key is checked before
#: it is read), so a longer one means node 0's host no longer answers: a network partition, where TCP neither
#: answers nor resets and a client without a deadline would wait for ever, holding the run loop (hang detection,
#: rank deaths, SIGTERM) and every other node's view of the job with it.
OP_TIMEOUT_S = 5.0
CONNECT_SLICE_S = 1.0  # a connect to a store not yet up is tried in slices this long, the stop asked between them


class StoreUnavailable(RuntimeError):
    """The store cannot be reached (its host is gone, or every etcd member is down)."""


class StoreRefused(StoreUnavailable):
    """The embedded store refused this node's secret: it serves another job (``serves`` names it, as the store
    says: not authenticated, for the message only)."""

    def __init__(self, message: str, serves: str) -> None:
        super().__init__(message)
        self.serves = serves


class StoreGone(StoreUnavailable):
    """The store's port answered while this node waited to connect, then nothing listened on it for longer than
    the caller allows: its host was lost before this node ever got in (a spare's cue to take node 0's place)."""


class KVStore(Protocol):
    """What the coordinator needs of a store."""

    def describe(self) -> str:
        """Where the store is, for messages (``embedded store 10.0.0.1:9780``, ``etcd a:2379,b:2379``)."""

    def set(self, key: str, value: bytes) -> None:
        """Write ``key`` (overwrites)."""

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when absent; never blocks on a missing key."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`get` of several keys in as few round trips as the store allows."""

    def poll(self, keys: Sequence[str], other: str | None = None) -> tuple[list[bytes] | None, bytes | None]:
        """One look for a wait: ``(values of keys, None)`` when every key exists, else ``(None, value of
        other)`` (None when ``other`` is absent or not given). Few round trips, and no values moved while a
        key is missing: one request to the embedded store, one transaction in etcd."""

    def wait_for_change(self, keys: Sequence[str], timeout: float) -> bool:
        """Between a wait's polls: up to ``timeout`` for one of ``keys`` to be written after this thread's last
        :meth:`poll`. False only when the store knows none was (the wait may skip its next poll); True when
        one was or it cannot tell. The embedded store sleeps (:func:`sleep_then_poll`); etcd watches."""

    def create(self, key: str, value: bytes) -> bytes:
        """Set ``key`` only if absent; return the value it holds afterwards (the first writer's)."""

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer counter ``key`` (0 when absent); the new value."""

    def delete(self, keys: Sequence[str]) -> None:
        """Remove ``keys`` (absent ones are no error): big records read for good (a hang's FR dumps) must not
        hold node 0's memory or etcd's quota. Never a key another node may still be waiting for."""

    def delete_prefix(self, prefix: str) -> None:
        """Remove every key under ``prefix`` (a finished job's keys in a store that outlives it)."""

    def close(self) -> None:
        """Release connections (and stop hosting, for the embedded store)."""


def sleep_then_poll(timeout: float) -> bool:
    """:meth:`KVStore.wait_for_change` of a store that cannot watch: sleep, then poll again."""
    time.sleep(timeout)
    return True


class EmbeddedKVStore:
    """The embedded store (:mod:`supervisor.cluster.kv_server`, over :mod:`supervisor.cluster.kv_wire`): node 0's
    supervisor hosts it when ``host_it`` (its own calls go straight to the table), the other nodes are clients
    holding the job's ``secret``. ``serves``: the job the host says it serves in its hello (for other jobs'
    messages). A client that the store refuses raises :class:`StoreRefused`."""

    def __init__(self, host: str, port: int, secret: bytes, host_it: bool, timeout_s: float,
                 op_timeout_s: float = OP_TIMEOUT_S, serves: dict | None = None) -> None:
        from supervisor.cluster.kv_server import KVServer, KVTable

        self.host, self.port = host, port
        self.op_timeout_s = op_timeout_s
        self._stalled = ""  # why this connection was given up (an operation got no answer in time, or broke)
        self._lock = threading.Lock()  # one request in flight per connection
        self._seen = threading.local()  # per thread: the number of the last write its last poll saw
        self._table: KVTable | None = None
        self._server: KVServer | None = None
        self._session: Session | None = None
        if host_it:
            table = KVTable()
            try:
                self._server = KVServer(port, secret, serves or {}, table)
            except OSError as e:
                raise StoreUnavailable(f"cannot host the coordination store {self.describe()}: {e}") from e
            self._table = table
            return
        sock = None
        try:
            deadline = time.monotonic() + timeout_s
            sock = socket.create_connection((host, port), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._session = client_handshake(sock, secret, deadline)
        except Refused as e:
            _close(sock)
            raise StoreRefused(f"coordination store {self.describe()}: {e}", e.serves) from e
        except (OSError, WireError) as e:
            _close(sock)
            raise StoreUnavailable(f"cannot reach the coordination store {self.describe()}: {e}") from e

    def describe(self) -> str:
        return f"embedded store {self.host}:{self.port}"

    def served_cpu_s(self) -> float:
        """CPU node 0's store has spent answering the other nodes (0 on a client), as far as its threads counted."""
        return self._server.cpu_s if self._server is not None else 0.0

    def _request(self, what: str, fields: list[bytes], extra_s: float = 0.0) -> list[bytes]:
        """One round trip, whole within ``op_timeout_s`` (+ ``extra_s``, what the request asks the store to wait) or
        given up: the connection is then dead for good (its answer may still come, out of turn), as after any
        failure or interruption between the request and its answer, and every later call fails at once; the
        coordinator reconnects (a fresh store) where it waits for node 0 to come back."""
        if self._stalled or self._session is None:
            raise StoreUnavailable(f"coordination store {self.describe()}: {self._stalled or 'closed'}")
        if not self._lock.acquire(timeout=self.op_timeout_s):
            raise StoreUnavailable(f"coordination store {self.describe()}: {what} waited {self.op_timeout_s:.0f}s "
                                   "for another call on this connection")
        try:
            deadline = time.monotonic() + self.op_timeout_s + extra_s
            self._session.send(fields, deadline)
            answer = self._session.receive(deadline)
        except ValueError:  # a request over the frame limit: nothing was sent, the connection stays good
            raise
        except TimeoutError:
            self._give_up(f"{what} got no answer within {self.op_timeout_s:g}s (its host is cut off or "
                          "stopped); this connection is given up")
        except (OSError, WireError) as e:
            self._give_up(f"{what} failed: {e}; this connection is given up")
        except BaseException:  # interrupted (KeyboardInterrupt, a stop): its answer would pair with the next request
            self._stalled = f"{what} was interrupted; this connection is given up"
            self._close_session()
            raise
        finally:
            self._lock.release()
        if answer[:1] != [b"ok"]:
            raise StoreUnavailable(f"coordination store {self.describe()}: {what} refused: "
                                   f"{b''.join(answer[1:2]).decode(errors='replace')}")
        return answer[1:]

    def _give_up(self, why: str) -> NoReturn:
        self._stalled = why
        self._close_session()
        raise StoreUnavailable(f"coordination store {self.describe()}: {why}")

    def _close_session(self) -> None:
        if self._session is not None:
            _close(self._session.sock)

    def set(self, key: str, value: bytes) -> None:
        if (table := self._table) is not None:  # read once: close() on another thread may clear it
            return table.set(key, value_bytes(value))
        self._request("set", [b"set", key.encode(), value_bytes(value)])

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = list(keys)
        if not keys:
            return []
        if (table := self._table) is not None:
            return table.get_many(keys)
        answer = self._request("get", [b"get", *(k.encode() for k in keys)])
        return [answer[i + 1] if answer[i] == b"1" else None for i in range(0, len(answer), 2)]

    def poll(self, keys: Sequence[str], other: str | None = None) -> tuple[list[bytes] | None, bytes | None]:
        keys = list(keys)
        if not keys:
            return [], None
        if (table := self._table) is not None:
            values, other_value, self._seen.seq = table.poll(keys, other)
            return values, other_value
        answer = self._request("poll", [b"poll", (other or "").encode(), *(k.encode() for k in keys)])
        self._seen.seq = int(answer[0])
        if answer[1] == b"1":
            return list(answer[2:]), None
        return None, answer[3] if answer[2] == b"1" else None

    def wait_for_change(self, keys: Sequence[str], timeout: float) -> bool:
        """Node 0's store is asked to hold the wait until one of ``keys`` is written after this thread's last
        :meth:`poll` (or ``timeout``); a thread that never polled sleeps. Never raises (as etcd's watch): a store
        that cannot be reached is the next poll's to report."""
        since = getattr(self._seen, "seq", None)
        if since is None or not keys:
            return sleep_then_poll(timeout)
        if (table := self._table) is not None:
            return table.wait(keys, since, timeout)
        try:
            answer = self._request("wait", [b"wait", str(since).encode(), str(max(0, int(timeout * 1000))).encode(),
                                            *(k.encode() for k in keys)], extra_s=timeout)
        except StoreUnavailable:
            return True  # cannot tell: the next poll fails at once on this connection, and says what that means
        return answer[0] == b"1"

    def create(self, key: str, value: bytes) -> bytes:
        if (table := self._table) is not None:
            return table.create(key, value_bytes(value))
        return self._request("create", [b"create", key.encode(), value_bytes(value)])[0]

    def add(self, key: str, amount: int) -> int:
        if (table := self._table) is not None:
            return table.add(key, amount)
        return int(self._request("add", [b"add", key.encode(), str(int(amount)).encode()])[0])

    def delete(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        if (table := self._table) is not None:
            return table.delete(keys)
        if keys:
            self._request("delete", [b"delete", *(k.encode() for k in keys)])

    def delete_prefix(self, prefix: str) -> None:
        """Nothing to do: the embedded store lives and dies with node 0's supervisor."""

    def close(self) -> None:
        self._table = None  # node 0's own calls fail from now on, as every client's do
        if self._server is not None:
            self._server.close()
        self._close_session()
        self._stalled = self._stalled or "closed"


def value_bytes(value: bytes | str) -> bytes:
    """A value as every store keeps it: bytes; str is taken as UTF-8."""
    return value.encode() if isinstance(value, str) else bytes(value)


def _close(sock: socket.socket | None) -> None:
    """Shut down, then close: a thread of ours blocked reading it wakes at once (close alone does not wake it)."""
    if sock is not None:
        for end in (lambda: sock.shutdown(socket.SHUT_RDWR), sock.close):
            try:
                end()
            except OSError:
                pass


def connect_store(host: str, port: int, secret: bytes, wait_s: float, stop: StopRequest | None,
                  gone_after_s: float | None = None) -> KVStore:
    """A client of the embedded store at ``host:port``, waited for up to ``wait_s``: the port is tried with
    connects of up to :data:`CONNECT_SLICE_S`, the stop asked between them
    (:class:`~supervisor.stop_request.StopAsked`). A store that refuses this job's secret raises
    :class:`StoreRefused` at once (it serves another job). ``gone_after_s``: a port that answered and then
    refuses connections for this long (refused: not a timeout, which a stalled or cut-off host also gives)
    raises :class:`StoreGone` at once instead of waiting out ``wait_s``."""
    deadline = time.monotonic() + wait_s
    answered, refused_since = False, None
    while True:
        if stop is not None:
            stop.check(f"the coordination store {host}:{port} (node 0) to answer")
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(CONNECT_SLICE_S, left))):
                pass
            answered, refused_since = True, None
            return EmbeddedKVStore(host, port, secret, False, max(1.0, min(CONNECT_SLICE_S * 5, left)))
        except StoreRefused:
            raise
        except (OSError, StoreUnavailable) as e:
            if answered and isinstance(e, ConnectionRefusedError):  # nothing listens (a stall or timeout is not that)
                refused_since = time.monotonic() if refused_since is None else refused_since
                if gone_after_s is not None and time.monotonic() - refused_since >= gone_after_s:
                    raise StoreGone(f"the coordination store {host}:{port} answered, then nothing listened "
                                    f"on it for {gone_after_s:g}s: {e}") from e
            if left <= CONNECT_SLICE_S:
                raise e if isinstance(e, StoreUnavailable) else StoreUnavailable(
                    f"cannot reach the coordination store {host}:{port}: {e}") from e
            time.sleep(min(CONNECT_SLICE_S / 4, max(0.0, deadline - time.monotonic())))
