"""The job's first round (supervisor.cluster.liveness) across runs and errors, in-process: a requeued run in a store
that outlives the job (a real etcd) is not ended by the previous run's ``abort`` or beats; rlsup's own error
ends the job for every node as a give-up (exit 1), not as a lost node (75, requeued for ever); the run loop's
watch of a peer's end makes one store call per poll where nothing can be reconnected (etcd).

Lapses are shortened (:data:`LAPSE_S`); every wait ends within :data:`PROMPT_S` (a thread join, a deadline),
never a timed assertion."""

from __future__ import annotations

import time


from etcd_cluster import EtcdCluster, etcd_cluster_clean, shared_etcd_cluster  # noqa: F401  (fixtures)

from supervisor.cluster.coordinator import PeerLost, RoundCoordinator
from supervisor.cluster.kvstore import KVStore
from test_first_round_requeue import JOB, LAPSE_S, REFRESH_S, SECRET, TIMEOUT_S, in_thread


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


