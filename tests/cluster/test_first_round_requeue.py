"""The job's first round (supervisor.cluster.liveness) across runs and errors, in-process: a requeued run in a store
that outlives the job (a real etcd) is not ended by the previous run's ``abort`` or beats; rlsup's own error
ends the job for every node as a give-up (exit 1), not as a lost node (75, requeued for ever); the run loop's
watch of a peer's end makes one store call per poll where nothing can be reconnected (etcd).

Lapses are shortened (:data:`LAPSE_S`); every wait ends within :data:`PROMPT_S` (a thread join, a deadline),
never a timed assertion."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Callable

import pytest

from etcd_cluster import EtcdCluster, etcd_cluster_clean, shared_etcd_cluster  # noqa: F401  (fixtures)
from support.fake_run_loop import FakeProcesses, Recorder
from support.ports import free_ports

from support import waits
from supervisor.config import SupervisorConfig
from supervisor.tiers.holdings import NodeInventory
from supervisor.cluster.coordinator import CoordinationError, PeerLost, RoundCoordinator, embedded_coordinator
from supervisor.job_identity import JobIdentity
from supervisor.cluster.kvstore import StoreUnavailable
from supervisor.cluster.liveness import LapseWatch
from supervisor.membership import Membership
from supervisor.cluster.multinode import NodeGroup
from supervisor.cluster.node_run import NodeRun

JOB = JobIdentity("job-q", "test")
SECRET = b"0123456789abcdef-requeue"
TIMEOUT_S = 300.0  # rendezvous_timeout: never waited out here
REFRESH_S, LAPSE_S = 0.05, 0.5
PROMPT_S = 30.0


def in_thread(call: Callable[[], object]) -> Callable[[], object]:
    return waits.in_thread(call, PROMPT_S)


def test_a_registered_beat_that_vanished_counts_as_silent() -> None:
    """The keys cleared after a lost peer: a node of that round that had not looked at ``abort`` still ends."""
    watch = LapseWatch(since=1000.0, lapse_s=10.0)
    assert watch.look({1: ("a", 1001.0)}, now=0.0) is None  # registered (written after the watcher started)
    assert watch.look({1: None}, now=5.0) is None
    lapse = watch.look({1: None}, now=10.0)
    assert lapse is not None and lapse.node == 1
    assert LapseWatch(since=1000.0, lapse_s=10.0).look({1: None}, now=99.0) is None  # never seen: nothing to judge


class CrashingEngine:
    """Node 1's replication engine, broken: its inventory raises (rlsup's own deterministic error)."""

    def inventory(self, known: object = None) -> NodeInventory:
        raise RuntimeError("inventory is broken")


def test_rlsups_own_error_ends_the_job_as_a_give_up_not_as_a_lost_node(tmp_path: Path) -> None:
    """Node 1's whole loop over a real store raises in its first round: it writes the job's abort (a give-up,
    naming it and the error) before the error leaves rlsup; node 0, waiting for its inventory, ends with a
    coordination error (exit 1), not PeerLost (exit 75: a requeue that crashes again)."""
    (port,) = free_ports(1)
    leader = embedded_coordinator("127.0.0.1", port, JOB, SECRET, 0, 2, TIMEOUT_S)
    leader.refresh_s, leader.lapses.lapse_s = REFRESH_S, LAPSE_S
    peers = ("127.0.0.1:1", "127.0.0.1:2")
    cfg = SupervisorConfig(checkpoint_dir=str(tmp_path / "ckpt"), state_dir=str(tmp_path / "state"), metrics_port=0,
                           poll_interval=0.005, warm_launcher=False, peers=list(peers), node_rank=1)
    sup = NodeRun.from_config(cfg, ["train"], Membership(peers, 1), CrashingEngine(),  # type: ignore[arg-type]
                              Recorder(), job=JOB, processes=FakeProcesses(),  # type: ignore[arg-type]
                              connect=lambda stop: embedded_coordinator("127.0.0.1", port, JOB, SECRET, 1, 2,
                                                                        TIMEOUT_S, stop))

    def round_of_node_0() -> object:
        leader.join(0)
        return leader.inventories(0)

    node_0 = in_thread(round_of_node_0)
    with pytest.raises(RuntimeError, match="inventory is broken"):
        sup.run()
    ended = node_0()
    assert isinstance(ended, CoordinationError) and not isinstance(ended, PeerLost), ended
    assert "node 1: rlsup failed: RuntimeError: inventory is broken" in str(ended)


class CutOffStore:
    """A store every call of which fails (etcd with no member answering), counting the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def get(self, key: str) -> bytes | None:
        self.calls += 1
        raise StoreUnavailable("etcd: no member answered")

    def describe(self) -> str:
        return "etcd (cut off)"


def test_the_watch_of_a_peers_end_makes_one_call_per_poll_where_nothing_reconnects() -> None:
    """etcd (no reconnect): each call blocks up to its timeout (30 s), so a poll that asked twice blocked 60 s."""
    store = CutOffStore()
    c = RoundCoordinator(store, JOB, SECRET, 1, 2, TIMEOUT_S)  # type: ignore[arg-type]  # reconnect=None: etcd
    loop = types.SimpleNamespace(coordinator=c, _store_lost=False, _log=lambda m: None)
    assert NodeGroup.peer_ended(loop, 3) is None  # type: ignore[arg-type]
    assert store.calls == 1
