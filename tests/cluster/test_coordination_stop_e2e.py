"""The end-to-end half of test_coordination_stop.py (real processes, or waits on real time): a stop asked while a
node waits for the others ends the wait at once, in every wait of the coordination (in-process, through a real
embedded store): the connect to a store nobody hosts yet, node 0 waiting for the other nodes to join (a peer that never
started), a node waiting for node 0 to open the first attempt, for the plan, for every node's fetch, for all to be
ready, and the reconnect after node 0's store is lost."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from support.fake_run_loop import FakeProcesses, Recorder

from supervisor import exit_codes
from supervisor.config import SupervisorConfig
from supervisor.cluster.round_errors import CoordinationError, JobClash
from supervisor.cluster.kvstore import connect_store
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.cluster.kvstore import EmbeddedKVStore
from supervisor.membership import Membership
from supervisor.cluster.node_run import NodeRun
from support.ports import free_port
from test_coordination_stop import JOB, SECRET, TIMEOUT_S, StopWhenWaiting, node, ends_with, assert_stopped, ends_with_later, OneNodeEngine











def test_the_connect_to_a_store_nobody_hosts_yet_and_the_wait_for_its_claim() -> None:
    stop = StopWhenWaiting("to answer", at=2)  # each look is a connect of up to CONNECT_SLICE_S
    e = ends_with(lambda: connect_store("127.0.0.1", free_port(), SECRET, TIMEOUT_S, stop))
    assert_stopped(e, "the coordination store 127.0.0.1:")
    stop = StopWhenWaiting("to answer", at=2)
    e = ends_with(lambda: node(free_port(), 1, stop))  # embedded_coordinator's first connect
    assert_stopped(e, "(node 0) to answer")
    port = free_port()
    unclaimed = EmbeddedKVStore("127.0.0.1", port, SECRET, True, 10)  # a store whose node 0 has not said whose it is yet
    stop = StopWhenWaiting("node 0 to claim the coordination store")
    assert_stopped(ends_with(lambda: node(port, 1, stop)), "node 0 to claim the coordination store")
    unclaimed.close()


def test_a_peer_that_refused_for_a_clash_ends_the_join_waits_as_a_clash() -> None:
    port = free_port()
    leader = node(port, 0, nodes=3)
    member = node(port, 1, nodes=3)
    waiting = [ends_with_later(lambda: leader.join(0)), ends_with_later(lambda: member.join(0))]
    refused = node(port, 2, nodes=3)  # node 2 reached the store, then refused (its state_dir is another job's)
    refused.abort("node 2 refused to start: state_dir /x/.rlsup is in use by rlsup job 'other'", clash=True)
    for result in waiting:
        e = result()
        assert isinstance(e, JobClash), repr(e)
        assert "node 2 refused to start" in str(e) and "in use by rlsup job 'other'" in str(e), str(e)


def test_a_plain_abort_ends_a_wait_as_a_coordination_error() -> None:
    port = free_port()
    leader = node(port, 0)
    result = ends_with_later(lambda: leader.join(0))
    node(port, 1).abort("node 1: gave up")
    e = result()
    assert isinstance(e, CoordinationError) and not isinstance(e, JobClash), repr(e)
    assert "aborted: node 1: gave up" in str(e)






def test_a_round_that_times_out_is_recorded_as_given_up(tmp_path: Path) -> None:
    """Node 1's loop (as above) with a 1 s rendezvous timeout: node 0 joins and never plans. The run ends
    with the coordination error the command line reports (exit 1), and state.json says the run gave up
    with that code: a later start must not take it for an rlsup that died mid-attempt."""
    import json

    port = free_port()
    leader = node(port, 0)
    peers = ("127.0.0.1:1", "127.0.0.1:2")
    cfg = SupervisorConfig(checkpoint_dir=str(tmp_path / "ckpt"), state_dir=str(tmp_path / "state"), metrics_port=0,
                           poll_interval=0.005, warm_launcher=False, peers=list(peers), node_rank=1)
    sup = NodeRun.from_config(cfg, ["train"], Membership(peers, 1), OneNodeEngine(),  # type: ignore[arg-type]
                              Recorder(), job=JOB, processes=FakeProcesses(),  # type: ignore[arg-type]
                              connect=lambda stop: embedded_coordinator("127.0.0.1", port, JOB, SECRET, 1, 2, 1.0,
                                                                        stop))
    threading.Thread(target=lambda: leader.join(0), daemon=True).start()  # node 0 joins, then never plans
    with pytest.raises(CoordinationError, match="timed out after 1s waiting for the plan of attempt 0"):
        sup.run()
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert (state["state"], state["exit_code"]) == ("gave_up", exit_codes.FAILED), state


