"""The KVStore contract of test_kvstore.py, run here on EtcdKVStore over a real 3-member etcd cluster; then
etcd's failover and loss of quorum."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import pytest

from etcd_cluster import EtcdCluster, etcd_cluster, etcd_cluster_clean, shared_etcd_cluster  # noqa: F401  (fixtures)
from supervisor.cluster.kvstore import KVStore, StoreUnavailable
from test_kvstore import (  # noqa: F401  (the contract's tests, collected here with this module's `connect`)
    TIMEOUT_S, _etcd_store, test_add_from_threads_is_exact, test_create_first_writer_wins,
    test_create_race_has_one_winner, test_delete_prefix, test_get_missing_is_none_without_blocking,
    test_set_get_overwrite)

Connect = Callable[[], KVStore]


@pytest.fixture
def connect(etcd_cluster_clean: EtcdCluster) -> Iterator[Connect]:  # noqa: F811
    """A fresh etcd cluster; calling the fixture's value opens one more client, spread over the members as nodes
    configured in different orders are."""
    opened: list[KVStore] = []

    def make() -> KVStore:
        opened.append(_etcd_store(etcd_cluster_clean, first=len(opened) % len(etcd_cluster_clean.endpoints)))
        return opened[-1]
    yield make
    for store in reversed(opened):
        store.close()



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


