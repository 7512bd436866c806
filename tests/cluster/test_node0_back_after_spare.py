"""Node 0 restarted after a spare took node rank 0 (and hosts the embedded store on node 0's address) is refused
as a node whose rank was taken: exit 77's SlotTaken, so it may rejoin as a spare; not the clash exit 2 of a node 0
running twice, which it still is when no spare holds rank 0. Real embedded stores on 127.0.0.1, in process."""

from __future__ import annotations


import pytest

from supervisor.config import SupervisorConfig, load_config
from supervisor.cluster.round_errors import NodeZeroRunning
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.job_identity import JobIdentity
from supervisor.membership import Membership
from supervisor.cluster.job_store import connect_coordinator
from supervisor.cluster.spares import SlotTaken, try_claim
from support.ports import free_port

JOB = JobIdentity("job-node0-back", "test")
SECRET = b"0123456789abcdef-shared"


def node_0_config(port: int, spares: int) -> SupervisorConfig:
    peers = ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9003"]
    return load_config(environ={}, overrides={"coordinator_port": port, "spares": spares, "rendezvous_timeout": 5,
                                              "peers": peers, "node_rank": 0}).config


def test_node_0_back_after_a_spare_took_its_rank_is_refused_as_taken() -> None:
    port = free_port()
    spare_hosted = embedded_coordinator("127.0.0.1", port, JOB, SECRET, 0, 2, 5)  # the spare re-hosted the store
    assert try_claim(spare_hosted, 0, "127.0.0.1:9003", 0) is not None
    back = Membership(("127.0.0.1:9001", "127.0.0.1:9002"), 0)
    with pytest.raises(SlotTaken, match="node rank 0 was given to the spare at 127.0.0.1:9003"):
        connect_coordinator(node_0_config(port, 1), back, JOB, SECRET)


def test_node_0_running_twice_is_still_a_clash() -> None:
    port = free_port()
    first = embedded_coordinator("127.0.0.1", port, JOB, SECRET, 0, 2, 5)
    second = Membership(("127.0.0.1:9001", "127.0.0.1:9002"), 0)
    for spares in (0, 1):
        with pytest.raises(NodeZeroRunning, match="running twice"):
            connect_coordinator(node_0_config(port, spares), second, JOB, SECRET)
    del first
