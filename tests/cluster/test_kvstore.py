"""The KVStore contract on the embedded store (a host and its clients on a free port), and its wire's authentication; the same contract on a
real 3-member etcd cluster, and etcd's failover and loss of quorum, are in test_kvstore_e2e.py."""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import pytest
from support.waits import wait_for

from support.ports import free_ports
from etcd_cluster import EtcdCluster
from supervisor.cluster.kvstore import EmbeddedKVStore, KVStore, StoreRefused, StoreUnavailable

TIMEOUT_S = 5.0
SECRET = b"0123456789abcdef-kvstore"
SERVES = {"job": "job-k", "source": "job_name"}
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
    opened: list[KVStore] = [EmbeddedKVStore("127.0.0.1", port, SECRET, True, TIMEOUT_S, serves=SERVES)]  # node 0 hosts

    def make() -> KVStore:
        opened.append(EmbeddedKVStore("127.0.0.1", port, SECRET, False, TIMEOUT_S))
        return opened[-1]
    make.host = opened[0]  # type: ignore[attr-defined]  # node 0's own handle (the embedded store's tests)
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
    a, b = connect(), connect()  # etcd's client may answer a set before every member has it: seen soon
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
    assert clients[1].get("t/count") == str(n * each - 10).encode()  # decimal text, as etcd keeps it too


def test_delete_prefix(connect: Connect) -> None:
    a = connect()
    for k in ("job1/a", "job1/b/c", "job10/a", "job2/a"):
        a.set(k, b"v")
    a.delete_prefix("job1/")
    if isinstance(a, EmbeddedKVStore):  # documented no-op: the embedded store dies with its job
        assert a.get("job1/a") == b"v"
        return
    assert a.get_many(["job1/a", "job1/b/c", "job10/a", "job2/a"]) == [None, None, b"v", b"v"]


# ---- the embedded store's one failure ----

def test_tcp_unavailable_after_host_closed() -> None:
    port = free_ports(1)[0]
    host = EmbeddedKVStore("127.0.0.1", port, SECRET, True, 2.0)
    client = EmbeddedKVStore("127.0.0.1", port, SECRET, False, 2.0)
    client.set("k", b"v")
    host.close()  # as when node 0's supervisor dies: its connections end
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"embedded store 127.0.0.1:{port}"):
        client.get("k")
    assert time.monotonic() - start < 3.0
    client.close()


def test_node_0_hosting_twice_on_one_port_is_refused_and_a_closed_host_frees_it() -> None:
    port = free_ports(1)[0]
    host = EmbeddedKVStore("127.0.0.1", port, SECRET, True, 2.0)
    with pytest.raises(StoreUnavailable, match=f"cannot host the coordination store embedded store 127.0.0.1:{port}"):
        EmbeddedKVStore("127.0.0.1", port, SECRET, True, 2.0)
    host.set("k", b"v")
    host.close()
    with pytest.raises(StoreUnavailable):
        host.get("k")  # node 0's own calls end with its store
    again = EmbeddedKVStore("127.0.0.1", port, SECRET, True, 2.0)  # a replacement node 0 binds at once
    assert again.get("k") is None
    again.close()


# ---- the embedded store's held waits ----

@pytest.mark.parametrize("through", ["client", "node 0"])
def test_a_wait_ends_at_the_first_write_after_the_poll_and_says_when_none_came(connect: Connect, through: str) -> None:
    """Node 0's store holds a wait between a node's polls until a watched key is written after that thread's
    poll: at once for a write made between the poll and the wait, early for one made during it; "nothing
    changed" (the next poll skipped) when only other keys were written."""
    writer = connect()
    waiter = connect.host if through == "node 0" else connect()  # type: ignore[attr-defined]
    keys = ["t/plan/1", "t/end/1"]
    assert waiter.poll(keys[:1], keys[1]) == (None, None)
    writer.set("t/plan/0", b"another attempt's")
    start = time.monotonic()
    assert waiter.wait_for_change(keys, 0.3) is False
    assert time.monotonic() - start >= 0.25
    writer.create(keys[1], b"node 3 failed")  # after the poll, before the wait
    assert waiter.wait_for_change(keys, 0.9) is True
    assert waiter.poll(keys[:1], keys[1]) == (None, b"node 3 failed")
    timer = threading.Timer(0.1, lambda: writer.set(keys[0], b"the plan"))
    timer.start()
    start = time.monotonic()
    assert waiter.wait_for_change(keys, 0.9) is True
    assert time.monotonic() - start < 0.8, "the write did not end the wait"
    timer.join()
    assert waiter.poll(keys[:1], keys[1]) == ([b"the plan"], None)


def test_a_wait_on_a_store_that_went_away_says_poll_and_the_poll_says_why(connect: Connect) -> None:
    waiter = connect()
    assert waiter.poll(["t/a"], None) == (None, None)
    connect.host.close()  # type: ignore[attr-defined]  # node 0 dies
    assert waiter.wait_for_change(["t/a"], 0.5) is True
    with pytest.raises(StoreUnavailable, match="given up|closed"):
        waiter.poll(["t/a"], None)


def test_a_thread_that_never_polled_sleeps_and_says_poll(connect: Connect) -> None:
    store = connect()
    out: list[bool] = []
    thread = threading.Thread(target=lambda: out.append(store.wait_for_change(["t/a"], 0.05)))
    thread.start()
    thread.join(10)
    assert out == [True]


# ---- the embedded store's wire: authenticated, bounded ----

def test_a_client_without_the_secret_is_refused_naming_the_job_the_store_serves(connect: Connect) -> None:
    host_port = connect()
    assert isinstance(host_port, EmbeddedKVStore)
    host_port.set("t/k", b"v")  # through a client of the job
    with pytest.raises(StoreRefused, match="serves rlsup job 'job-k' \\(job_name\\) and refused this node's secret") as e:
        EmbeddedKVStore("127.0.0.1", host_port.port, b"another-secret-of-16+", False, TIMEOUT_S)
    assert e.value.serves == "rlsup job 'job-k' (job_name)"
    assert host_port.get("t/k") == b"v"


def test_the_wire_refuses_what_is_not_a_verified_frame(connect: Connect) -> None:
    """Raw sockets: a request before the handshake, a wrong proof, an oversized handshake frame and a frame whose
    tag does not verify all end the connection without touching a key; the store serves on."""
    import socket

    from supervisor.cluster import kv_wire

    first = connect()
    assert isinstance(first, EmbeddedKVStore)
    first.set("t/k", b"v")
    port = first.port

    def raw() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        assert kv_wire.read_plain(s)[0] == kv_wire.MAGIC  # the hello
        return s

    def closed(s: socket.socket) -> bool:
        try:
            while s.recv(65536):
                pass
            return True
        except ConnectionResetError:
            return True
        finally:
            s.close()

    s = raw()  # a request instead of the proof
    kv_wire.send_plain(s, [b"set", b"t/k", b"forged"])
    assert closed(s)
    s = raw()  # a wrong proof: told, then closed
    kv_wire.send_plain(s, [b"\0" * kv_wire.NONCE_BYTES, b"\0" * 32])
    assert kv_wire.read_plain(s)[0] == b"refused" and closed(s)
    s = raw()  # a handshake frame over its limit is not read
    s.sendall((kv_wire.MAX_HELLO_BYTES + 1).to_bytes(4, "big"))
    assert closed(s)
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)  # authenticated, then a bad tag
    session = kv_wire.client_handshake(s, SECRET)
    body = kv_wire.encode([b"set", b"t/k", b"forged"])
    s.sendall(len(body).to_bytes(4, "big") + body + b"\0" * kv_wire.TAG_BYTES)
    assert closed(s)
    del session
    assert connect().get("t/k") == b"v"  # nothing was written, and the store still serves


def test_a_handshake_is_bounded_as_a_whole_and_strangers_have_few_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stranger that trickles its handshake a byte at a time is cut off at the handshake's deadline (not per
    read), and connections not yet authenticated are capped apart from the nodes' (MAX_HANDSHAKING)."""
    import socket

    from supervisor.cluster import kv_server, kv_wire

    monkeypatch.setattr(kv_server, "HANDSHAKE_S", 0.6)
    monkeypatch.setattr(kv_server, "MAX_HANDSHAKING", 1)
    port = free_ports(1)[0]
    host = EmbeddedKVStore("127.0.0.1", port, SECRET, True, 2.0)
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5.0)
        assert kv_wire.read_plain(s)[0] == kv_wire.MAGIC
        second = socket.create_connection(("127.0.0.1", port), timeout=5.0)  # over the cap: closed at once
        assert second.recv(1) == b""
        second.close()
        start, ended = time.monotonic(), False
        s.settimeout(0.2)
        while time.monotonic() - start < 3.0 and not ended:
            try:
                s.send(b"\0")  # a byte within every read's own timeout, never a whole frame
                ended = s.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                ended = True
        assert ended and time.monotonic() - start < 2.0, "a trickled handshake outlived its deadline"
        s.close()
        wait_for(lambda: _connects(port), 5.0, "a node to get in once the stranger's slot was freed")
    finally:
        host.close()


def _connects(port: int) -> bool:
    try:
        EmbeddedKVStore("127.0.0.1", port, SECRET, False, 2.0).close()
        return True
    except StoreUnavailable:
        return False


def test_a_request_the_store_cannot_do_is_an_error_and_the_connection_goes_on(connect: Connect) -> None:
    client = connect()
    assert isinstance(client, EmbeddedKVStore)
    session = client._session  # the wire itself: requests rlsup's client never makes
    assert session is not None
    session.send([b"wait", b"0", b"9" * 400, b"t/k"])  # a timeout no float holds
    assert session.receive()[0] == b"err"
    session.send([b"nonsense"])
    assert session.receive()[:1] == [b"err"]
    client.set("t/k", b"v")
    assert client.get("t/k") == b"v"


def test_an_interrupted_request_gives_its_connection_up(connect: Connect, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer that comes after an interruption would pair with the next request: the connection goes."""
    client = connect()
    assert isinstance(client, EmbeddedKVStore) and client._session is not None

    def interrupted(deadline: float | None = None) -> list[bytes]:
        raise KeyboardInterrupt

    monkeypatch.setattr(client._session, "receive", interrupted)
    with pytest.raises(KeyboardInterrupt):
        client.get("t/k")
    monkeypatch.undo()
    with pytest.raises(StoreUnavailable, match="interrupted; this connection is given up"):
        client.get("t/k")


def test_a_client_gives_a_stalled_connection_up_and_fails_at_once_after() -> None:
    """A store that accepts and then never answers (node 0 stopped or cut off): the connect fails within its
    timeout; an operation on a connection whose host then stalls, within op_timeout_s, and every later one at once."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel's backlog), never says hello
    port = listener.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="cannot reach the coordination store"):
        EmbeddedKVStore("127.0.0.1", port, SECRET, False, 1.0)
    assert time.monotonic() - start < 3.0
    listener.close()

    port = free_ports(1)[0]
    host = EmbeddedKVStore("127.0.0.1", port, SECRET, True, 2.0)
    client = EmbeddedKVStore("127.0.0.1", port, SECRET, False, 2.0, op_timeout_s=0.5)
    assert client.add("t/n", 2) == 2
    host._table._lock.acquire()  # the host stalls: its table never answers
    try:
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="got no answer within 0.5s"):
            client.get("t/n")
        assert time.monotonic() - start < 2.0
        with pytest.raises(StoreUnavailable, match="this connection is given up"):
            client.get("t/n")
    finally:
        host._table._lock.release()
        client.close()
        host.close()


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
