"""The embedded coordination store across a network partition: node 0's store in a namespace of its own
(support.partition), a client in the test's. Cut off, TCP neither answers nor resets and a client without a
deadline would wait for ever; rlsup's store gives the operation up after ``op_timeout_s``, and every later call fails at once
(StoreUnavailable), so the run loop polling it goes on. Healed, a fresh connection reads the same keys."""

from __future__ import annotations

import subprocess
import sys

import pytest

from supervisor.cluster.kvstore import EmbeddedKVStore, StoreUnavailable
from support.env import clean_env
from support.partition import Partition, why_unavailable
from support.ports import free_ports
from support.waits import wait_for

SECRET = b"0123456789abcdef-partition"
HOST = ("import sys, time; from supervisor.cluster.kvstore import EmbeddedKVStore; "
        f"s = EmbeddedKVStore('0.0.0.0', int(sys.argv[1]), {SECRET!r}, True, 60); "
        "s.set('k', b'v'); print('up', flush=True); time.sleep(300)")


@pytest.mark.skipif(why_unavailable() is not None, reason=f"partitions unavailable: {why_unavailable()}")
def test_a_cut_off_store_fails_fast_and_a_fresh_connection_works_once_healed() -> None:
    port = free_ports(1)[0]
    with Partition(1) as net:
        host = subprocess.Popen([*net.wrap(0), sys.executable, "-c", HOST, str(port)], stdout=subprocess.PIPE, text=True,
                                env=clean_env())
        try:
            assert host.stdout is not None and host.stdout.readline().strip() == "up"
            store = wait_for(lambda: _connect(net.addrs[0], port), 30, "the store to accept a client")
            assert store.get("k") == b"v"
            net.cut([0])
            with pytest.raises(StoreUnavailable, match="got no answer within 1s"):
                store.get("k")
            with pytest.raises(StoreUnavailable, match="this connection is given up"):
                store.get("k")  # at once: the stalled connection is never used again
            net.heal()
            fresh = wait_for(lambda: _connect(net.addrs[0], port), 30, "a fresh connection once healed")
            assert fresh.get("k") == b"v"
        finally:
            host.kill()
            host.wait(timeout=30)


def _connect(addr: str, port: int) -> EmbeddedKVStore | None:
    try:
        return EmbeddedKVStore(addr, port, SECRET, False, 5.0, op_timeout_s=1.0)
    except StoreUnavailable:
        return None
