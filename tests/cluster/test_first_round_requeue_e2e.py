"""The end-to-end half of test_first_round_requeue.py (real processes, or waits on real time): the job's first
round (supervisor.cluster.liveness) across runs and errors, in-process: a requeued run in a store that outlives the
job (a real etcd) is not ended by the previous run's ``abort`` or beats; rlsup's own error ends the job for every
node as a give-up (exit 1), not as a lost node (75, requeued for ever); the run loop's watch of a peer's end makes
one store call per poll where nothing can be reconnected (etcd)."""

from __future__ import annotations


import time


from etcd_cluster import EtcdCluster, etcd_cluster_clean, shared_etcd_cluster  # noqa: F401  (fixtures)

from supervisor.cluster.coordinator import RoundCoordinator

from supervisor.cluster.round_errors import PeerLost
from supervisor.cluster.kvstore import KVStore
from test_first_round_requeue import JOB, SECRET, TIMEOUT_S
from pathlib import Path
from typing import Callable
import pytest
from support.fake_run_loop import FakeProcesses, Recorder
from support.ports import free_ports
from support import waits
from supervisor.config import SupervisorConfig
from supervisor.tiers.holdings import NodeInventory
from supervisor.cluster.round_errors import CoordinationError
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.membership import Membership
from supervisor.cluster.node_run import NodeRun


def test_a_requeued_run_in_etcd_is_not_ended_by_the_previous_runs_abort_or_beats(
        etcd_cluster_clean: EtcdCluster) -> None:  # noqa: F811
    """Run 1: node 2 joins, then dies before the first attempt; nodes 0 and 1 end the round (PeerLost) and clear
    its keys as the run loop does after its linger. Run 2 (the requeue, seconds later, same etcd): every node healthy,
    node 2 starting later than a lapse: all three join attempt 0, nobody is aborted or judged lost."""
    from supervisor.cluster.kvstore_etcd import EtcdKVStore

    def store() -> KVStore:
        return EtcdKVStore(etcd_cluster_clean.endpoints, 10.0)

    def coord(rank: int) -> RoundCoordinator:
        c = RoundCoordinator(store(), JOB, SECRET, rank, 3, TIMEOUT_S, beat_store=store)
        c.refresh_s, c.lapses.lapse_s = REFRESH_S, LAPSE_S
        return c

    first = [coord(rank) for rank in range(3)]
    joins = [in_thread(lambda c=c: c.join(0)) for c in first]
    assert [j() for j in joins] == [0, 0, 0]
    doomed = first.pop()
    assert doomed.beat is not None
    doomed.beat.stop()  # node 2 dies before the first attempt
    ends = [in_thread(lambda: first[0].inventories(0)), in_thread(lambda: first[1].plan(0))]
    lost = [end() for end in ends]
    assert all(isinstance(e, PeerLost) for e in lost), lost
    for c in first:
        c.forget_first_round()

    second = [coord(0), coord(1)]
    joins = [in_thread(lambda c=c: c.join(0)) for c in second]
    # node 2 starts four lapses late: a delay it is given, not a wait for something (a stale beat of run 1's node 2,
    # were it counted, would be judged lost meanwhile)
    late = in_thread(lambda: (time.sleep(LAPSE_S * 4), coord(2).join(0))[1])
    assert [j() for j in joins] + [late()] == [0, 0, 0]


REFRESH_S, LAPSE_S = 0.05, 0.5


PROMPT_S = 30.0


def in_thread(call: Callable[[], object]) -> Callable[[], object]:
    return waits.in_thread(call, PROMPT_S)


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

