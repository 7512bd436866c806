"""The job's first round (supervisor.cluster.liveness) across runs and errors, in-process: a requeued run in a store
that outlives the job (a real etcd) is not ended by the previous run's ``abort`` or beats; rlsup's own error
ends the job for every node as a give-up (exit 1), not as a lost node (75, requeued for ever); the run loop's
watch of a peer's end makes one store call per poll where nothing can be reconnected (etcd).

Lapses are shortened (:data:`LAPSE_S`); every wait ends within :data:`PROMPT_S` (a thread join, a deadline),
never a timed assertion."""

from __future__ import annotations

import types


from etcd_cluster import EtcdCluster, etcd_cluster_clean, shared_etcd_cluster  # noqa: F401  (fixtures)

from supervisor.cluster.coordinator import RoundCoordinator
from supervisor.job_identity import JobIdentity
from supervisor.cluster.kvstore import StoreUnavailable
from supervisor.cluster.liveness import LapseWatch
from supervisor.cluster.multinode import NodeGroup

JOB = JobIdentity("job-q", "test")
SECRET = b"0123456789abcdef-requeue"
TIMEOUT_S = 300.0  # rendezvous_timeout: never waited out here


def test_a_registered_beat_that_vanished_counts_as_silent() -> None:
    """The keys cleared after a lost peer: a node of that round that had not looked at ``abort`` still ends."""
    watch = LapseWatch(since=1000.0, lapse_s=10.0)
    assert watch.look({1: ("a", 1001.0)}, now=0.0) is None  # registered (written after the watcher started)
    assert watch.look({1: None}, now=5.0) is None
    lapse = watch.look({1: None}, now=10.0)
    assert lapse is not None and lapse.node == 1
    assert LapseWatch(since=1000.0, lapse_s=10.0).look({1: None}, now=99.0) is None  # never seen: nothing to judge


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
