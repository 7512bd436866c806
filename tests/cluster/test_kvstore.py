"""The KVStore contract on the embedded TCPKVStore (a host and its clients on a free port); the same contract on a
real 3-member etcd cluster, and etcd's failover and loss of quorum, are in test_kvstore_e2e.py."""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import pytest
from support.waits import wait_for

from support.ports import free_ports
from etcd_cluster import EtcdCluster
from supervisor.cluster.kvstore import KVStore, StoreUnavailable, TCPKVStore

TIMEOUT_S = 5.0
Connect = Callable[[], KVStore]


def _etcd_store(cluster: EtcdCluster, first: int = 0, timeout_s: float = TIMEOUT_S, **kw) -> KVStore:
    """A client that starts on member ``first`` and knows all of them."""
    from supervisor.cluster.kvstore_etcd import EtcdKVStore

    eps = cluster.endpoints
    return EtcdKVStore(eps[first:] + eps[:first], timeout_s, **kw)


@pytest.fixture
def connect() -> Iterator[Connect]:
    """A fresh embedded store; calling the fixture's value opens one more client (one more node)."""
    port = free_ports(1)[0]
    opened: list[KVStore] = [TCPKVStore("127.0.0.1", port, True, TIMEOUT_S)]  # node 0 hosts

    def make() -> KVStore:
        opened.append(TCPKVStore("127.0.0.1", port, False, TIMEOUT_S))
        return opened[-1]
    yield make
    for store in reversed(opened):
        store.close()


def _race(n: int, fn: Callable[[int], object]) -> list[object]:
    """Run ``fn(0..n-1)`` on ``n`` threads released together; their results, or re-raise the first error."""
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = fn(i)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a racing thread hung"
    if errors:
        raise errors[0]
    return results


# ---- the contract (test_kvstore_e2e.py runs it on etcd too) ----

def test_set_get_overwrite(connect: Connect) -> None:
    a, b = connect(), connect()  # TCPStore's set is not answered: another client sees it soon, not at once
    a.set("t/k", b"\x00\xffbinary")
    wait_for(lambda: b.get("t/k") == b"\x00\xffbinary", TIMEOUT_S, "the value from the other client")
    b.set("t/k", b"second")
    wait_for(lambda: a.get("t/k") == b"second", TIMEOUT_S, "the overwrite from the other client")
    a.set("t/empty", b"")
    wait_for(lambda: b.get("t/empty") == b"", TIMEOUT_S, "the empty value from the other client")


def test_get_missing_is_none_without_blocking(connect: Connect) -> None:
    a, b = connect(), connect()
    start = time.monotonic()
    assert a.get("t/never-written") is None
    assert time.monotonic() - start < 1.0
    b.set("t/x", b"1")
    b.set("t/z", b"3")
    start = time.monotonic()
    assert a.get_many(["t/x", "t/missing", "t/z"]) == [b"1", None, b"3"]
    assert a.get_many(["t/missing"]) == [None]
    assert a.get_many([]) == []
    assert time.monotonic() - start < 1.0


def test_create_first_writer_wins(connect: Connect) -> None:
    a, b = connect(), connect()
    assert a.create("t/end/1", b"a's reason") == b"a's reason"
    assert b.create("t/end/1", b"b's reason") == b"a's reason"
    assert b.get("t/end/1") == b"a's reason"


def test_create_race_has_one_winner(connect: Connect) -> None:
    n = 6
    clients = [connect() for _ in range(n)]
    got = _race(n, lambda i: clients[i].create("t/race", f"node{i}".encode()))
    assert len(set(got)) == 1, got  # everyone reads the same winner
    winners = [i for i in range(n) if got[i] == f"node{i}".encode()]
    assert len(winners) == 1, got
    assert clients[0].get("t/race") == got[0]


def test_add_from_threads_is_exact(connect: Connect) -> None:
    n, each = 4, 15
    clients = [connect() for _ in range(n)]
    assert clients[0].add("t/count", 0) == 0  # absent counts as 0

    def bump(i: int) -> list[int]:
        return [clients[i].add("t/count", 1) for _ in range(each)]

    seen = sorted(v for vs in _race(n, bump) for v in vs)  # type: ignore[union-attr]
    assert seen == list(range(1, n * each + 1))  # every add saw its own total: none lost, none doubled
    assert clients[0].add("t/count", -10) == n * each - 10
    assert clients[1].get("t/count") == str(n * each - 10).encode()  # decimal text, as TCPStore keeps it


def test_delete_prefix(connect: Connect) -> None:
    a = connect()
    for k in ("job1/a", "job1/b/c", "job10/a", "job2/a"):
        a.set(k, b"v")
    a.delete_prefix("job1/")
    if isinstance(a, TCPKVStore):  # documented no-op: the embedded store dies with its job
        assert a.get("job1/a") == b"v"
        return
    assert a.get_many(["job1/a", "job1/b/c", "job10/a", "job2/a"]) == [None, None, b"v", b"v"]


# ---- the embedded store's one failure ----

def test_tcp_unavailable_after_host_closed() -> None:
    port = free_ports(1)[0]
    host = TCPKVStore("127.0.0.1", port, True, 2.0)
    client = TCPKVStore("127.0.0.1", port, False, 2.0)
    client.set("k", b"v")
    host.close()
    del host  # the TCPStore server goes with its last reference
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"TCPStore 127.0.0.1:{port}"):
        client.get("k")
    assert time.monotonic() - start < 3.0
    client.close()


# ---- etcd: failover and quorum ----


def test_etcd_nothing_listening_raises_naming_every_endpoint() -> None:
    from supervisor.cluster.kvstore_etcd import EtcdKVStore

    endpoints = [f"127.0.0.1:{p}" for p in free_ports(2)]
    store = EtcdKVStore(endpoints, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="no etcd member answered within 0.5s") as err:
        store.create("k", b"v")
    assert time.monotonic() - start < 1.5
    assert all(e in str(err.value) for e in endpoints)
    assert "ConnectionFailedError" in str(err.value)


def test_prefix_end() -> None:
    from supervisor.cluster.kvstore_etcd import _prefix_end

    assert _prefix_end(b"job1/") == b"job10"
    assert _prefix_end(b"a\xff") == b"b"
    assert _prefix_end(b"\xff\xff") == b"\0"
