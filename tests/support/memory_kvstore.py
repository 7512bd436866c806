"""The coordination store in memory: :class:`supervisor.cluster.kvstore.KVStore` for several simulated nodes in one
process (each node's :class:`~supervisor.cluster.coordinator.RoundCoordinator` on its own thread, all over one
:class:`MemoryKVStore`).

It keeps the semantics every store keeps (:mod:`supervisor.cluster.kvstore`): ``create`` is atomic, ``get`` never
blocks, ``poll`` moves no value while a key is missing. Unlike the embedded store, which sleeps between a wait's
polls, :meth:`MemoryKVStore.wait_for_change` watches as etcd does: it returns as soon as a watched key is written,
so a round of several nodes takes milliseconds and no test sleeps.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from supervisor.cluster.kvstore import StoreUnavailable


class MemoryKVStore:
    """A dict behind one lock; every write bumps a sequence number that the waits watch. ``before_poll(store,
    keys)``: called before each :meth:`poll` on the polling thread, to hold a node back and so order the nodes'
    looks as a test needs (see :meth:`wait_until_written`)."""

    def __init__(self, name: str = "memory",
                 before_poll: Callable[["MemoryKVStore", Sequence[str]], None] | None = None) -> None:
        self.name = name
        self.before_poll = before_poll
        self._values: dict[str, bytes] = {}
        self._written_at: dict[str, int] = {}  # key -> the sequence number of its last write
        self._seq = 0
        self._changed = threading.Condition()
        self._seen = threading.local()  # per thread: the sequence number at its last poll
        self.writes: list[str] = []  # every key written, in order (what crossed the store)
        self.gone = False  # set: every call fails as a store gone with node 0 does (StoreUnavailable)

    def _reachable(self) -> None:
        if self.gone:
            raise StoreUnavailable(f"{self.describe()} is gone")

    def describe(self) -> str:
        return f"in-memory store {self.name}"

    def _write(self, key: str, value: bytes) -> None:
        """Under the lock: store and wake every wait."""
        self._seq += 1
        self._values[key] = bytes(value)
        self._written_at[key] = self._seq
        self.writes.append(key)
        self._changed.notify_all()

    def set(self, key: str, value: bytes) -> None:
        self._reachable()
        with self._changed:
            self._write(key, value)

    def get(self, key: str) -> bytes | None:
        self._reachable()
        with self._changed:
            return self._values.get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self._reachable()
        with self._changed:
            return [self._values.get(k) for k in keys]

    def poll(self, keys: Sequence[str], other: str | None = None) -> tuple[list[bytes] | None, bytes | None]:
        self._reachable()
        if self.before_poll is not None:
            self.before_poll(self, keys)
        with self._changed:
            self._seen.seq = self._seq
            if all(k in self._values for k in keys):
                return [self._values[k] for k in keys], None
            return None, self._values.get(other) if other is not None else None

    def wait_for_change(self, keys: Sequence[str], timeout: float) -> bool:
        """Up to ``timeout`` for one of ``keys`` to be written after this thread's last :meth:`poll`."""
        seen = getattr(self._seen, "seq", 0)
        with self._changed:
            return self._changed.wait_for(lambda: any(self._written_at.get(k, 0) > seen for k in keys), timeout)

    def wait_until_written(self, keys: Sequence[str], timeout: float) -> bool:
        """Block the calling thread until every one of ``keys`` exists (at most ``timeout``); whether they do."""
        with self._changed:
            return self._changed.wait_for(lambda: all(k in self._values for k in keys), timeout)

    def create(self, key: str, value: bytes) -> bytes:
        self._reachable()
        with self._changed:
            if key not in self._values:
                self._write(key, value)
            return self._values[key]

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            total = int(self._values.get(key, b"0")) + amount
            self._write(key, str(total).encode())
            return total

    def delete(self, keys: Sequence[str]) -> None:
        with self._changed:
            for key in keys:
                self._values.pop(key, None)
                self._written_at.pop(key, None)

    def delete_prefix(self, prefix: str) -> None:
        with self._changed:
            self.delete([k for k in self._values if k.startswith(prefix)])

    def keys(self, prefix: str = "") -> list[str]:
        """The keys held under ``prefix``, sorted (for a test's eye)."""
        with self._changed:
            return sorted(k for k in self._values if k.startswith(prefix))

    def close(self) -> None:
        """Nothing to release: the store lives as long as the test holds it."""
