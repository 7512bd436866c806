"""``EtcdKVStore.wait_for_change`` on a real 3-member etcd cluster: a wait's watch is woken by a write after
its poll (never missing one), tells "nothing changed" when nothing did, and falls back to polling when the
watch breaks (its member killed, a message over the limit). The embedded store on a thread that never polled says "poll again" (its held waits: test_kvstore.py)."""

from __future__ import annotations

import threading

import pytest

from etcd_cluster import EtcdCluster, etcd_cluster, etcd_cluster_clean, shared_etcd_cluster  # noqa: F401  (fixtures)
from support.ports import free_ports
from supervisor.cluster.kvstore import EmbeddedKVStore
from supervisor.cluster.kvstore_etcd import EtcdKVStore

KEYS = ["w/plan/1", "w/end/1"]
LONG_S = 60.0  # a wait this long only ends on a write (or a broken watch): the test never waits it out


def _store(cluster: EtcdCluster, first: int = 0) -> EtcdKVStore:
    eps = cluster.endpoints
    return EtcdKVStore(eps[first:] + eps[:first], timeout_s=10.0)


def _wait_in_thread(store: EtcdKVStore, keys: list[str], timeout: float) -> tuple[threading.Thread, list[bool]]:
    """``store.poll`` then ``store.wait_for_change`` on a thread of their own (both are per thread)."""
    out: list[bool] = []
    ready = threading.Event()

    def run() -> None:
        assert store.poll(keys[:1], keys[1]) == (None, None)
        ready.set()
        out.append(store.wait_for_change(keys, timeout))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "the poll did not return"
    return thread, out


def test_a_write_after_the_poll_wakes_the_wait(etcd_cluster_clean: EtcdCluster) -> None:  # noqa: F811
    waiter, writer = _store(etcd_cluster_clean), _store(etcd_cluster_clean, first=1)
    thread, out = _wait_in_thread(waiter, KEYS, LONG_S)
    writer.set(KEYS[0], b"the plan")  # before or after the watch opened: it watches from the poll's revision
    thread.join(30)
    assert not thread.is_alive(), "a write did not wake the wait"
    assert out == [True]
    values, _ = waiter.poll(KEYS[:1], KEYS[1])
    assert values == [b"the plan"]
    waiter.close()
    writer.close()


def test_a_write_between_the_poll_and_the_watch_is_not_missed(etcd_cluster_clean: EtcdCluster) -> None:  # noqa: F811
    """The attempt's end, written after the poll but before the wait opened its watch: the watch starts at the
    poll's revision, so the wait ends at once (it would otherwise wait LONG_S), and the end is read."""
    waiter, writer = _store(etcd_cluster_clean), _store(etcd_cluster_clean, first=2)
    assert waiter.poll(KEYS[:1], KEYS[1]) == (None, None)
    writer.create(KEYS[1], b"node 3 failed")
    assert waiter.wait_for_change(KEYS, LONG_S) is True
    assert waiter.poll(KEYS[:1], KEYS[1]) == (None, b"node 3 failed")
    waiter.close()
    writer.close()


def test_nothing_written_says_nothing_changed(etcd_cluster_clean: EtcdCluster) -> None:  # noqa: F811
    """A write elsewhere (another attempt's key) neither wakes the wait nor is missed by it."""
    waiter, writer = _store(etcd_cluster_clean), _store(etcd_cluster_clean, first=1)
    writer.set("w/plan/0", b"an older attempt's")
    thread, out = _wait_in_thread(waiter, KEYS, 0.3)
    writer.set("w/plan/2", b"another attempt's")
    thread.join(30)
    assert out == [False]
    waiter.close()
    writer.close()


def test_every_key_of_a_wait_all_is_seen(etcd_cluster_clean: EtcdCluster) -> None:  # noqa: F811
    """Node 0's kind of wait (a key per node): woken by the writes, then every value read."""
    keys = [f"w/inv/1/{n}" for n in range(12)] + ["w/end/1"]
    waiter, writer = _store(etcd_cluster_clean), _store(etcd_cluster_clean, first=1)
    writer.set(keys[3], b"3")  # written before the poll: read by it, never told by the watch
    got: list[object] = []

    def wait_all() -> None:
        for _ in range(200):  # as RoundCoordinator._wait: poll, and wait between polls
            values, ended = waiter.poll(keys[:-1], keys[-1])
            if values is not None or ended is not None:
                got.append(values)
                return
            waiter.wait_for_change(keys, 5.0)

    thread = threading.Thread(target=wait_all, daemon=True)
    thread.start()
    for n in range(12):
        writer.set(keys[n], str(n).encode())
    thread.join(60)
    assert not thread.is_alive(), "the wait never saw every key"
    assert got == [[str(n).encode() for n in range(12)]]
    waiter.close()
    writer.close()


def test_a_broken_watch_falls_back_to_polling(etcd_cluster: EtcdCluster) -> None:  # noqa: F811
    """The watch's member is SIGKILLed mid-wait: the wait says "poll", the poll fails over to another member
    and finds the write made meanwhile; the next waits poll instead of watching."""
    waiter = _store(etcd_cluster)
    thread, out = _wait_in_thread(waiter, KEYS, LONG_S)
    used = waiter.endpoint
    writer = EtcdKVStore([e for e in etcd_cluster.endpoints if e != used], timeout_s=10.0)
    etcd_cluster.kill(etcd_cluster.index_of(used))
    thread.join(30)
    assert not thread.is_alive(), "a broken watch held the wait"
    assert out == [True]
    writer.set(KEYS[0], b"after the loss")
    assert waiter.poll(KEYS[:1], KEYS[1]) == ([b"after the loss"], None)
    assert waiter.endpoint != used
    waiter.close()
    writer.close()


def test_a_watch_message_over_the_limit_breaks_the_watch(etcd_cluster_clean: EtcdCluster) -> None:  # noqa: F811
    waiter, writer = _store(etcd_cluster_clean), _store(etcd_cluster_clean, first=1)
    waiter.watch_message_limit = 1024
    assert waiter.poll(KEYS[:1], KEYS[1]) == (None, None)
    writer.set(KEYS[0], b"x" * 4096)  # its event is over 1 KiB
    assert waiter.wait_for_change(KEYS, LONG_S) is True  # the watch broke on it: "poll"
    assert waiter.poll(KEYS[:1], KEYS[1]) == ([b"x" * 4096], None)  # read by the poll, not taken from the event
    waiter.close()
    writer.close()


def test_the_embedded_store_always_polls() -> None:
    port = free_ports(1)[0]
    host = EmbeddedKVStore("127.0.0.1", port, b"0123456789abcdef-watch", True, 5.0)
    try:
        assert host.wait_for_change(KEYS, 0.01) is True
    finally:
        host.close()


@pytest.mark.parametrize("keys", [[], ["w/a"]])
def test_without_a_poll_the_wait_only_sleeps(etcd_cluster_clean: EtcdCluster, keys: list[str]) -> None:  # noqa: F811
    """No poll on this thread yet (no revision to watch from), or nothing to watch: sleep, then poll."""
    store = _store(etcd_cluster_clean)
    assert store.wait_for_change(keys, 0.01) is True
    store.close()
