"""Two jobs on the same "hosts" (127.0.0.1, each node its own working directory), as users run them:
relative default directories (``replicas``, ``.rlsup``) and the default coordinator port 9780.

- One after the other, each with its own checkpoint_dir: the second starts fresh (it never resumes from
  the first job's replicas), and the first, run again, resumes its own last step.
- At the same time: the second job refuses to start, naming the clash (the replication port, the
  coordination store and the job that holds it, the state or the replica directory), and the first is
  untouched.
"""

from __future__ import annotations

from pathlib import Path

from support.ports import free_ports
from support.procs import run_rlsup
from support.waits import wait_for
from support.cluster import Cluster, assert_same_weights, reference_weights, rlsup_resumes, trainer_starts

SHORT = ["--steps", "9", "--checkpoint-every", "3", "--step-time", "0.05", "--keep-last", "100"]
# Job A must outlive every other job's refusal (CI once saw a loaded machine finish A's 40 steps first).
LONG = ["--steps", "100", "--checkpoint-every", "5", "--step-time", "0.5", "--keep-last", "100"]  # A outlives B, C, D and E under load


def like(cluster: Cluster, other: Cluster) -> Cluster:
    """``cluster`` on the same ports and token as ``other`` (the same hosts, the same defaults)."""
    cluster.repl_ports, cluster.coord_port, cluster.master_port = other.repl_ports, other.coord_port, other.master_port
    cluster.token = other.token
    return cluster


def run_to_end(cluster: Cluster) -> None:
    try:
        for node in range(cluster.nodes):
            cluster.start(node)
        codes = cluster.wait_all(timeout=240)
        assert codes == {n: 0 for n in range(cluster.nodes)}, cluster.logs()
    finally:
        cluster.kill_all()


def test_jobs_one_after_the_other_never_share_checkpoints(tmp_path: Path) -> None:
    ref = reference_weights(tmp_path, 2, SHORT)
    a = Cluster(tmp_path, 2, extra=["--checkpoint-dir", "ckpt-a"], train_args=SHORT, log_name="a.log")
    a.coord_port = None  # the default port, 9780
    run_to_end(a)
    assert trainer_starts(a.log(0)) == [0]
    b = like(Cluster(tmp_path, 2, extra=["--checkpoint-dir", "ckpt-b"], train_args=SHORT, log_name="b.log"), a)
    run_to_end(b)
    # Job A's replicas of step 9 sit in the same replica directories; job B must not see them.
    assert rlsup_resumes(b.log(0)) == [None] and trainer_starts(b.log(0)) == [0], b.log(0)[-3000:]
    assert "starting fresh" in b.log(0)
    assert_same_weights(b.node_dir(0) / b.out_name, ref)
    for node in range(2):
        namespaces = sorted(p.name for p in (b.node_dir(node) / "replicas").iterdir() if not p.name.startswith("."))
        assert len(namespaces) == 2 and all(".node" in n for n in namespaces), namespaces  # one per job
    # Job A again, as after a requeue or a restart of rlsup: it resumes its own last step.
    again = like(Cluster(tmp_path, 2, extra=["--checkpoint-dir", "ckpt-a"], train_args=SHORT, log_name="a2.log"), a)
    run_to_end(again)
    assert rlsup_resumes(again.log(0)) == [9] and trainer_starts(again.log(0)) == [9], again.log(0)[-3000:]


def test_a_second_job_on_the_same_hosts_refuses_and_the_first_is_untouched(tmp_path: Path) -> None:
    ref = reference_weights(tmp_path, 2, LONG)
    for name in "abc":
        (tmp_path / name).mkdir()
    a = Cluster(tmp_path / "a", 2, train_args=LONG)
    a.coord_port = None  # the default port, 9780
    try:
        for node in range(2):
            a.start(node)
        wait_for(lambda: all("launching" in a.log(n) for n in range(2)), 120, "job A running on both nodes")

        # D: a single-node job started in A's node-0 directory: the state directory is A's.
        d = run_rlsup(["run", "--checkpoint-dir", "ckpt-d", "--metrics-port", "0", "--", "true"], a.node_dir(0))
        assert d.returncode == 2 and "state_dir" in d.stderr and "is in use by rlsup job" in d.stderr, d.stderr

        # E: a node of another job (its own ports and state_dir) in A's node-1 directory: the replica_dir is A's.
        e_ports = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
        e = run_rlsup(["run", "--peers", e_ports, "--node-rank", "1", "--token-file", str(a.token), "--state-dir",
                       "state-e", "--metrics-port", "0", "--", "true"], a.node_dir(1))
        assert e.returncode == 2 and "replica_dir" in e.stderr and "is in use by rlsup job" in e.stderr, e.stderr

        # B: launched the same way from other directories, same peers: its replication ports are A's.
        b = like(Cluster(tmp_path / "b", 2, train_args=LONG), a)
        for node in range(2):
            b.start(node)
        assert b.wait_all(timeout=120) == {0: 2, 1: 2}, b.logs()
        for node in range(2):
            assert f"replication endpoint 127.0.0.1:{a.repl_ports[node]}" in b.log(node), b.log(node)

        # C: its own replication ports, but the default coordinator port that A's node 0 holds.
        c = Cluster(tmp_path / "c", 2, train_args=LONG)
        c.coord_port, c.token = None, a.token
        for node in range(2):
            c.start(node)
        assert c.wait_all(timeout=120) == {0: 2, 1: 2}, c.logs()
        assert "coordinator port 9780 on 127.0.0.1 is taken by rlsup job" in c.log(0), c.log(0)
        assert "is hosted for rlsup job" in c.log(1) and "this node is job" in c.log(1), c.log(1)

        assert a.wait_all(timeout=300) == {0: 0, 1: 0}, a.logs()
    finally:
        a.kill_all()
    for node in range(2):
        assert "rejoined" not in a.log(node) and "ignored" not in a.log(node), a.log(node)[-3000:]
    assert len(rlsup_resumes(a.log(0))) == 1  # one attempt: nothing of B, C or D reached it
    assert_same_weights(a.node_dir(0) / a.out_name, ref)
