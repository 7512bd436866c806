"""A node that reaches the store and then dies before its job's first attempt (issue 32): real ``rlsup run``
nodes on 127.0.0.1, each in its own directory, torchrun c10d as users type it, rendezvous_timeout 300 s.

Node 2 is held inside the first round by a pre_launch_check that waits for a file (it has joined: the job's
first attempt is opened, nodes 0 and 1 wait for its inventory), then SIGKILLed there, as a power cut or the
OOM killer would. Nodes 0 and 1 must exit within :data:`PROMPT_S` (a deadline on the wait for their exit,
far below the timeout the test would otherwise wait out) with 75, so the scheduler requeues the job, naming
node 2 and why; nothing was launched, state.json says the run gave up with 75. With the embedded store and
with etcd (the same rule through a 3-member etcd cluster). Under ``--soak`` (tests/conftest.py's
option) also the requeue: the three nodes started again run the job to its end, bit-identical to an
uninterrupted run (nothing was lost, and a run that ended 75 does not stand in the next one's way)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from etcd_cluster import EtcdCluster, etcd_cluster_clean, shared_etcd_cluster  # noqa: F401 - the fixtures
from support.cluster import Cluster, assert_same_weights, reference_weights
from support.waits import wait_for

SHORT = ["--steps", "6", "--checkpoint-every", "3", "--step-time", "0.05", "--keep-last", "100"]
PROMPT_S = 90.0  # far below rendezvous_timeout (300 s): a node still waiting then waited for the timeout


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return reference_weights(tmp_path_factory.mktemp("ref"), 3, SHORT)


def held_check(d: Path) -> str:
    """A pre_launch_check that says it runs (``checking``), then waits for ``go`` (bounded: it outlives the
    node it belongs to, in a session of its own)."""
    return f"touch {d}/checking; for i in $(seq 600); do [ -e {d}/go ] && exit 0; sleep 0.1; done"


def exit_code(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=PROMPT_S)
    except subprocess.TimeoutExpired:
        return -999  # still waiting: the assertion names it


def dies_in_the_first_round(cluster: Cluster, ref: dict | None) -> None:
    hold = cluster.root / "hold"
    hold.mkdir()
    try:
        cluster.start(0)
        cluster.start(1)
        cluster.start(2, extra=["--pre-launch-check", held_check(hold)])
        wait_for(lambda: (hold / "checking").exists(), 120, "node 2 inside the first round (its pre_launch_check)")
        cluster.procs[2].send_signal(signal.SIGKILL)
        assert cluster.procs[2].wait(timeout=30) == -signal.SIGKILL
        codes = [exit_code(cluster.procs[n]) for n in (0, 1)]
    finally:
        (hold / "go").touch()
        cluster.kill_all()
    assert codes == [75, 75], f"{codes}\n{cluster.logs()}"
    for n in (0, 1):
        log = cluster.log(n)
        assert "node 2 (host " in log and "liveness beat stopped" in log, log[-4000:]
        assert "before the job's first attempt" in log and "exiting 75" in log, log[-4000:]
        assert "launching" not in log, log[-4000:]
        state = cluster.state(n)
        assert (state["state"], state["exit_code"]) == ("gave_up", 75), state
    if ref is None:
        return

    # The requeue: the same nodes, started again, finish the job bit-identical.
    cluster.new_ports()
    try:
        cluster.start_all()
        codes = [cluster.procs[n].wait(timeout=240) for n in range(3)]
    finally:
        cluster.kill_all()
    assert codes == [0, 0, 0], cluster.logs()
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)


def test_a_node_killed_in_the_first_round_ends_the_others_with_75(tmp_path: Path) -> None:
    dies_in_the_first_round(Cluster(tmp_path, 3, train_args=SHORT, rendezvous_timeout=300), None)


def test_a_node_killed_in_the_first_round_ends_the_others_with_75_etcd(tmp_path: Path,
                                                                       etcd_cluster_clean: EtcdCluster) -> None:  # noqa: F811
    etcd = ["--coordinator-backend", "etcd", "--coordinator-endpoints", ",".join(etcd_cluster_clean.endpoints)]
    dies_in_the_first_round(Cluster(tmp_path, 3, extra=etcd, train_args=SHORT, rendezvous_timeout=300), None)


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_a_node_killed_in_the_first_round_then_the_requeue_finishes_bit_identical(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("--soak", default=None):
        pytest.skip("soak: pass --soak MINUTES")
    dies_in_the_first_round(Cluster(tmp_path, 3, train_args=SHORT, rendezvous_timeout=300),
                            request.getfixturevalue("ref"))
