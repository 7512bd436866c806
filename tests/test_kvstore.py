"""The KVStore contract, run against both stores: the embedded TCPKVStore (a host and its clients on a
free port) and EtcdKVStore on a real 3-member etcd cluster; then etcd's failover and loss of quorum."""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import pytest
from support.waits import wait_for

from support.ports import free_ports
from etcd_cluster import EtcdCluster, etcd_cluster, etcd_cluster_clean, shared_etcd_cluster  # noqa: F401  (fixtures)
from supervisor.cluster.kvstore import KVStore, StoreUnavailable, TCPKVStore

TIMEOUT_S = 5.0
Connect = Callable[[], KVStore]


def _etcd_store(cluster: EtcdCluster, first: int = 0, timeout_s: float = TIMEOUT_S, **kw) -> KVStore:
    """A client that starts on member ``first`` and knows all of them."""
    from supervisor.cluster.kvstore_etcd import EtcdKVStore

    eps = cluster.endpoints
    return EtcdKVStore(eps[first:] + eps[:first], timeout_s, **kw)


@pytest.fixture(params=["tcp", "etcd"])
def connect(request: pytest.FixtureRequest) -> Iterator[Connect]:
    """A fresh store of each kind; calling the fixture's value opens one more client (one more node)."""
    opened: list[KVStore] = []
    if request.param == "tcp":
        port = free_ports(1)[0]
        opened.append(TCPKVStore("127.0.0.1", port, True, TIMEOUT_S))  # node 0 hosts

        def make() -> KVStore:
            opened.append(TCPKVStore("127.0.0.1", port, False, TIMEOUT_S))
            return opened[-1]
    else:
        cluster: EtcdCluster = request.getfixturevalue("etcd_cluster_clean")

        def make() -> KVStore:  # clients spread over the members, as nodes configured in different orders
            opened.append(_etcd_store(cluster, first=len(opened) % len(cluster.endpoints)))
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


# ---- the contract, on both stores ----

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


def test_etcd_delete_keys(etcd_cluster_clean: EtcdCluster) -> None:  # noqa: F811
    """etcd's delete (the embedded store's: tests/test_fr_exchange_waits.py, through the FR exchange; one more
    TCPStore server in this module's process made the next one's connects time out now and then)."""
    a = _etcd_store(etcd_cluster_clean)
    for k in ("fr/1/0", "fr/1/1", "fr/1/verdict"):
        a.set(k, b"v" * 1000)
    a.delete(["fr/1/0", "fr/1/1", "fr/1/absent"])  # an absent key is no error
    assert a.get_many(["fr/1/0", "fr/1/1", "fr/1/verdict"]) == [None, None, b"v" * 1000]
    assert a.poll(["fr/1/0"], "fr/1/verdict") == (None, b"v" * 1000)  # a deleted key reads as never written
    a.set("fr/1/0", b"again")  # and can be written again
    assert a.get("fr/1/0") == b"again"
    a.close()


# ---- etcd: failover and quorum ----

def test_etcd_fails_over_when_the_member_in_use_is_killed(etcd_cluster: EtcdCluster) -> None:  # noqa: F811
    store = _etcd_store(etcd_cluster, timeout_s=10.0)
    other = _etcd_store(etcd_cluster, first=2)
    store.set("f/a", b"1")
    assert store.create("f/leader", b"first") == b"first"
    assert store.add("f/n", 1) == 1
    used = store.endpoint

    etcd_cluster.kill(etcd_cluster.index_of(used))
    start = time.monotonic()
    assert store.get("f/a") == b"1"  # same call, another member
    failover_s = time.monotonic() - start
    assert store.endpoint != used
    store.set("f/b", b"2")
    assert store.create("f/leader", b"second") == b"first"
    assert store.add("f/n", 1) == 2
    assert other.get_many(["f/a", "f/b", "f/n"]) == [b"1", b"2", b"2"]
    assert failover_s < 5.0, failover_s

    # The killed member rejoins; then losing another one still leaves a quorum.
    etcd_cluster.restart(etcd_cluster.index_of(used))
    etcd_cluster.kill(etcd_cluster.index_of(store.endpoint))
    assert store.add("f/n", 1) == 3
    assert other.get("f/b") == b"2"
    store.close()
    other.close()


def test_etcd_without_quorum_raises_store_unavailable_in_time(etcd_cluster: EtcdCluster) -> None:  # noqa: F811
    store = _etcd_store(etcd_cluster, timeout_s=1.5)
    store.set("q/a", b"1")
    etcd_cluster.kill(0)
    etcd_cluster.kill(1)  # the survivor has no majority: it can neither read (linearizably) nor write
    for op in (lambda: store.get("q/a"), lambda: store.set("q/b", b"2")):
        start = time.monotonic()
        with pytest.raises(StoreUnavailable) as err:
            op()
        elapsed = time.monotonic() - start
        assert 1.4 < elapsed < 2.5, elapsed
        for endpoint in etcd_cluster.endpoints:
            assert endpoint in str(err.value)
        assert "last error" in str(err.value)
    store.close()


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


def test_etcd_add_lost_answer_is_not_counted_twice(etcd_cluster_clean: EtcdCluster) -> None:  # noqa: F811
    """A member that commits an add and dies before answering: the retry must find it, not add again."""
    from supervisor.cluster import kvstore_etcd

    store = _etcd_store(etcd_cluster_clean)
    assert store.add("r/n", 5) == 5
    real = store._attempt
    lost = []

    def commit_then_lose_answer(i: int, path: str, payload: dict, timeout: float) -> dict:
        result = real(i, path, payload, timeout)
        if path == "kv/txn" and not lost:
            lost.append(path)
            raise kvstore_etcd._Unanswered("simulated: member died after committing")
        return result

    store._attempt = commit_then_lose_answer  # type: ignore[method-assign]
    assert store.add("r/n", 2) == 7
    assert lost and store.get("r/n") == b"7"
    left = store._post("check", "kv/range", {"key": kvstore_etcd._b64(b"r/n"),
                                             "range_end": kvstore_etcd._b64(b"r/o"), "count_only": True})
    assert int(left.get("count", 0)) == 1  # the receipts are gone
    store.close()


def test_prefix_end() -> None:
    from supervisor.cluster.kvstore_etcd import _prefix_end

    assert _prefix_end(b"job1/") == b"job10"
    assert _prefix_end(b"a\xff") == b"b"
    assert _prefix_end(b"\xff\xff") == b"\0"
