"""The key-value store the node supervisors agree through, behind one small interface.

Two stores sit behind it: the embedded one (a torch ``TCPStore`` hosted by node 0's supervisor, as
torchrun's c10d rendezvous hosts its own) and etcd v3 (:mod:`supervisor.cluster.kvstore_etcd`), a highly
available store whose loss of one member or of any one node stalls nobody. The coordinator
(:mod:`supervisor.cluster.coordinator`) signs and namespaces what it writes; a store only moves bytes.

Semantics every store keeps: keys are never rewritten by the protocol except through :meth:`set`;
:meth:`create` is atomic (the first writer wins, everyone reads the winner); :meth:`get` never blocks.
A store that cannot be reached raises :class:`StoreUnavailable`, within :data:`OP_TIMEOUT_S` even when its
host is cut off and TCP neither answers nor resets (torch's TCPStore client then waits for ever).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, TypeVar

if TYPE_CHECKING:
    from supervisor.stop_request import StopRequest

#: The longest one TCPStore operation may take. Every operation is immediate (a key is checked before it is
#: read), so a longer one means node 0's host no longer answers: a network partition, where TCP neither
#: answers nor resets and torch's client waits for ever, holding the run loop (hang detection, rank deaths,
#: SIGTERM) and every other node's view of the job with it.
OP_TIMEOUT_S = 5.0
CONNECT_SLICE_S = 1.0  # the store's connect blocks in torch, deaf to signals: it is tried in slices this long
T = TypeVar("T")


class StoreUnavailable(RuntimeError):
    """The store cannot be reached (its host is gone, or every etcd member is down)."""


class StoreGone(StoreUnavailable):
    """The store's port answered while this node waited to connect, then nothing listened on it for longer than
    the caller allows: its host was lost before this node ever got in (a spare's cue to take node 0's place)."""


class KVStore(Protocol):
    """What the coordinator needs of a store."""

    def describe(self) -> str:
        """Where the store is, for messages (``TCPStore 10.0.0.1:9780``, ``etcd a:2379,b:2379``)."""

    def set(self, key: str, value: bytes) -> None:
        """Write ``key`` (overwrites)."""

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when absent; never blocks on a missing key."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`get` of several keys in as few round trips as the store allows."""

    def poll(self, keys: Sequence[str], other: str | None = None) -> tuple[list[bytes] | None, bytes | None]:
        """One look for a wait: ``(values of keys, None)`` when every key exists, else ``(None, value of
        other)`` (None when ``other`` is absent or not given). Few round trips, and no values moved while a
        key is missing: TCPStore checks the keys, then reads ``other`` or every value; etcd does it all in
        one transaction."""

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


class TCPKVStore:
    """The embedded store: torch's TCPStore, hosted when ``host_it`` (node 0's supervisor)."""

    def __init__(self, host: str, port: int, host_it: bool, timeout_s: float, op_timeout_s: float = OP_TIMEOUT_S) -> None:
        from torch.distributed import TCPStore

        self.host, self.port = host, port
        # Not timeout_s: that is the connect's (a short slice, where it is retried). None on node 0, whose store
        # is served in this process: no partition comes between them.
        self.op_timeout_s = None if host_it else op_timeout_s
        self._stalled = ""  # why this connection was given up (an operation got no answer in time)

        def connect() -> "TCPStore":
            return TCPStore(host, port, None, host_it, timedelta(seconds=timeout_s), wait_for_workers=False)
        try:
            # A client's connect is an operation too: a host that accepts the connection and then never answers
            # (stopped, hung) would hold torch's handshake for ever, whatever its timeout.
            self._store = connect() if host_it else self._bounded("connect", connect, timeout_s + 1.0)
        except StoreUnavailable as e:  # the bounded connect: torch's own error, or no answer in time
            raise StoreUnavailable(f"cannot reach the coordination store {self.describe()}: {e.__cause__ or e}") from e
        except Exception as e:  # torch raises several types; all mean the same here
            raise StoreUnavailable(f"cannot {'host' if host_it else 'reach'} the coordination store "
                                   f"{self.describe()}: {e}") from e

    def describe(self) -> str:
        return f"TCPStore {self.host}:{self.port}"

    def _call(self, what: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a daemon thread, given up after ``op_timeout_s``: the connection is then dead for
        good (its answer may still come, out of turn) and every later call fails at once; the coordinator
        reconnects (a fresh store) where it waits for node 0 to come back."""
        if self._stalled:
            raise StoreUnavailable(f"coordination store {self.describe()}: {self._stalled}")
        if self.op_timeout_s is None:
            try:
                return fn(*args)
            except Exception as e:  # DistNetworkError, DistStoreError, RuntimeError: the host is gone
                raise StoreUnavailable(f"coordination store {self.describe()}: {what} failed: {e}") from e
        return self._bounded(what, lambda: fn(*args), self.op_timeout_s)

    def _bounded(self, what: str, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn()`` on a daemon thread, given up (for good: see :meth:`_call`) after ``timeout_s``."""
        outcome: list = []
        done = threading.Event()

        def run() -> None:
            try:
                outcome.append((True, fn()))
            except Exception as e:  # noqa: BLE001 - DistNetworkError, DistStoreError, RuntimeError: the host is gone
                outcome.append((False, e))
            done.set()

        threading.Thread(target=run, name=f"rlsup-store-{what}", daemon=True).start()
        if not done.wait(timeout_s):
            self._stalled = (f"{what} got no answer within {timeout_s:.0f}s (its host is cut off or "
                             "stopped); this connection is given up")
            raise StoreUnavailable(f"coordination store {self.describe()}: {self._stalled}")
        ok, value = outcome[0]
        if not ok:
            raise StoreUnavailable(f"coordination store {self.describe()}: {what} failed: {value}") from value
        return value

    def set(self, key: str, value: bytes) -> None:
        self._call("set", self._store.set, key, value)

    def get(self, key: str) -> bytes | None:
        if not self._call("check", self._store.check, [key]):
            return None
        return self._call("get", self._store.get, key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = list(keys)
        if not keys:
            return []
        if self._call("check", self._store.check, keys):  # one round trip for the common case
            return list(self._call("multi_get", self._store.multi_get, keys))
        return [self.get(k) for k in keys]

    def poll(self, keys: Sequence[str], other: str | None = None) -> tuple[list[bytes] | None, bytes | None]:
        keys = list(keys)
        if not keys:
            return [], None
        # Between check and multi_get a key could go only through delete(), which spares keys still waited for.
        if self._call("check", self._store.check, keys):
            return list(self._call("multi_get", self._store.multi_get, keys)), None
        return None, self.get(other) if other is not None else None

    def wait_for_change(self, keys: Sequence[str], timeout: float) -> bool:
        return sleep_then_poll(timeout)  # TCPStore's own wait blocks without a deadline we could interrupt

    def create(self, key: str, value: bytes) -> bytes:
        # TCPStore's compare_set with an empty expected value sets a missing key, else returns the current one.
        return bytes(self._call("compare_set", self._store.compare_set, key, "", value))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", self._store.add, key, amount))

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._call("delete_key", self._store.delete_key, key)

    def delete_prefix(self, prefix: str) -> None:
        """Nothing to do: the embedded store lives and dies with node 0's supervisor."""

    def close(self) -> None:
        self._store = None  # type: ignore[assignment]  # the TCPStore (and its server) go with the object


def connect_store(host: str, port: int, wait_s: float, stop: StopRequest | None,
                  gone_after_s: float | None = None) -> KVStore:
    """A client of the TCPStore at ``host:port``, waited for up to ``wait_s``. torch's connect blocks in C++
    where no signal handler runs (and logs a stack trace per retry), so the port is first awaited with
    plain connects of up to :data:`CONNECT_SLICE_S`, the stop asked between them
    (:class:`~supervisor.stop_request.StopAsked`); torch connects once the port answers, each try bounded (a
    resolver that does not answer torch's lookups costs one try). ``gone_after_s``: a port that answered and
    then refuses connections for this long (refused: not a timeout, which a stalled or cut-off host also gives)
    raises :class:`StoreGone` at once instead of waiting out ``wait_s``."""
    deadline = time.monotonic() + wait_s
    answered, refused_since = False, None
    while True:
        if stop is not None:
            stop.check(f"the coordination store TCPStore {host}:{port} (node 0) to answer")
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(CONNECT_SLICE_S, left))):
                pass
            answered, refused_since = True, None
            return TCPKVStore(host, port, False, max(1.0, min(CONNECT_SLICE_S * 5, left)))
        except (OSError, StoreUnavailable) as e:
            if answered and isinstance(e, ConnectionRefusedError):  # nothing listens (a stall or timeout is not that)
                refused_since = time.monotonic() if refused_since is None else refused_since
                if gone_after_s is not None and time.monotonic() - refused_since >= gone_after_s:
                    raise StoreGone(f"the coordination store TCPStore {host}:{port} answered, then nothing listened "
                                    f"on it for {gone_after_s:g}s: {e}") from e
            if left <= CONNECT_SLICE_S:
                raise e if isinstance(e, StoreUnavailable) else StoreUnavailable(
                    f"cannot reach the coordination store TCPStore {host}:{port}: {e}") from e
            time.sleep(min(CONNECT_SLICE_S / 4, max(0.0, deadline - time.monotonic())))
