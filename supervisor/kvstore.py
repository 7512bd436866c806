"""The key-value store the node supervisors agree through, behind one small interface.

Two stores sit behind it: the embedded one (a torch ``TCPStore`` hosted by node 0's supervisor, as
torchrun's c10d rendezvous hosts its own) and etcd v3 (:mod:`supervisor.kvstore_etcd`), a highly
available store whose loss of one member or of any one node stalls nobody. The coordinator
(:mod:`supervisor.coordinator`) signs and namespaces what it writes; a store only moves bytes.

Semantics every store keeps: keys are never rewritten by the protocol except through :meth:`set`;
:meth:`create` is atomic (the first writer wins, everyone reads the winner); :meth:`get` never blocks.
A store that cannot be reached raises :class:`StoreUnavailable`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal, Protocol, Sequence

#: The stores, by the name ``coordinator_backend`` gives them (the config's choices): ``embedded``, the
#: TCPStore node 0's supervisor hosts (:class:`TCPKVStore`), or ``etcd`` (:mod:`supervisor.kvstore_etcd`);
#: ``multinode.connect_coordinator`` picks the store by these names.
CoordinatorBackend = Literal["embedded", "etcd"]


class StoreUnavailable(RuntimeError):
    """The store cannot be reached (its host is gone, or every etcd member is down)."""


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


class TCPKVStore:
    """The embedded store: torch's TCPStore, hosted when ``host_it`` (node 0's supervisor)."""

    def __init__(self, host: str, port: int, host_it: bool, timeout_s: float) -> None:
        from torch.distributed import TCPStore

        self.host, self.port = host, port
        try:
            self._store = TCPStore(host, port, None, host_it, timedelta(seconds=timeout_s), wait_for_workers=False)
        except Exception as e:  # torch raises several types; all mean the same here
            raise StoreUnavailable(f"cannot {'host' if host_it else 'reach'} the coordination store "
                                   f"{self.describe()}: {e}") from e

    def describe(self) -> str:
        return f"TCPStore {self.host}:{self.port}"

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except StoreUnavailable:
            raise
        except Exception as e:  # DistNetworkError, DistStoreError, RuntimeError: the host is gone
            raise StoreUnavailable(f"coordination store {self.describe()}: {what} failed: {e}") from e

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
