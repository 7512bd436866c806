"""Two jobs on the same "hosts" (127.0.0.1, each node its own working directory), as users run them:
relative default directories (``replicas``, ``.rlsup``) and the default coordinator port 9780.

- At the same time: the second job refuses to start, naming the clash (the replication port, the
  coordination store and the job that holds it, the state or the replica directory), and the first is
  untouched.
- One after the other, each with its own checkpoint_dir: the second starts fresh (it never resumes from
  the first job's replicas), and the first, run again, resumes its own last step.

Both are one sequence of jobs (:func:`jobs`, run once for the module): job A runs while B, C, D and E are
refused, then job B2 runs in A's directories after it, then A again. Each test asserts its half.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support.ports import free_ports
from support.procs import run_rlsup
from support.waits import wait_for
from support.cluster import Cluster, assert_same_weights, reference_weights, rlsup_resumes, trainer_starts

SHORT = ["--steps", "9", "--checkpoint-every", "3", "--step-time", "0.05", "--keep-last", "100"]
# Job A must outlive every other job's refusal (CI once saw a loaded machine finish A's 40 steps first).
LONG = ["--steps", "100", "--checkpoint-every", "5", "--step-time", "0.5", "--keep-last", "100"]  # A outlives B, C, D and E under load
# The whole sequence (four jobs of two nodes, two refusals) runs in the setup of whichever test comes first, which
# pytest-timeout counts as that test's: more than the default 300 s on a loaded machine.
pytestmark = pytest.mark.timeout(900)


def like(cluster: Cluster, other: Cluster) -> Cluster:
    """``cluster`` on the same ports and token as ``other`` (the same hosts, the same defaults)."""
    cluster.repl_ports, cluster.coord_port, cluster.master_port = other.repl_ports, other.coord_port, other.master_port
    cluster.token = other.token
    return cluster


def run_to_end(cluster: Cluster) -> dict[int, int]:
    """Every node of ``cluster`` to its end: their exit codes (asserted by the tests)."""
    try:
        for node in range(cluster.nodes):
            cluster.start(node)
        return cluster.wait_all(timeout=240)
    finally:
        cluster.kill_all()


@dataclass
class Jobs:
    """What the sequence left: each job's cluster (its logs) and exit codes, the refusals' outputs."""
    a: Cluster
    d: subprocess.CompletedProcess | None = None
    e: subprocess.CompletedProcess | None = None
    b: Cluster | None = None
    c: Cluster | None = None
    codes: dict[str, dict[int, int]] = field(default_factory=dict)
    b2: Cluster | None = None
    again: Cluster | None = None


def refuse_beside(jobs: Jobs, root: Path) -> None:
    """While A runs: D, E, B and C are started on the same hosts, all at once (they clash with A, not with one
    another: the sooner all are refused, the surer A still runs meanwhile), and refused."""
    a = jobs.a
    e_ports = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    with ThreadPoolExecutor(2) as pool:
        # D: a single-node job started in A's node-0 directory: the state directory is A's.
        d = pool.submit(run_rlsup, ["run", "--checkpoint-dir", "ckpt-d", "--metrics-port", "0", "--", "true"],
                        a.node_dir(0))
        # E: a node of another job (its own ports and state_dir) in A's node-1 directory: the replica_dir is A's.
        e = pool.submit(run_rlsup, ["run", "--peers", e_ports, "--node-rank", "1", "--token-file", str(a.token),
                                    "--state-dir", "state-e", "--metrics-port", "0", "--", "true"], a.node_dir(1))
        # B: launched the same way from other directories, same peers: its replication ports are A's.
        jobs.b = like(Cluster(root / "b", 2, train_args=LONG), a)
        # C: its own replication ports, but the default coordinator port that A's node 0 holds.
        jobs.c = Cluster(root / "c", 2, train_args=LONG)
        jobs.c.coord_port, jobs.c.token = None, a.token
        for node in range(2):
            jobs.b.start(node)
            jobs.c.start(node)
        jobs.codes["b"] = jobs.b.wait_all(timeout=120)
        jobs.codes["c"] = jobs.c.wait_all(timeout=120)
        jobs.d, jobs.e = d.result(), e.result()
    jobs.codes["a running after the refusals"] = {n: int(p.poll() is None) for n, p in a.procs.items()}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """Job A (2 nodes, checkpoint_dir ``ckpt-a``, the default coordinator port) to its end with D, E, B and C
    refused beside it; then job B2 (``ckpt-b``) in A's node directories after it; then A again."""
    root = tmp_path_factory.mktemp("jobs")
    for name in "abc":
        (root / name).mkdir()
    a = Cluster(root / "a", 2, extra=["--checkpoint-dir", "ckpt-a"], train_args=LONG, log_name="a.log")
    a.coord_port = None  # the default port, 9780
    jobs = Jobs(a)
    try:
        for node in range(2):
            a.start(node)
        wait_for(lambda: all("launching" in a.log(n) for n in range(2)), 120, "job A running on both nodes")
        refuse_beside(jobs, root)
        jobs.codes["a"] = a.wait_all(timeout=300)
    finally:
        a.kill_all()
    jobs.b2 = like(Cluster(root / "a", 2, extra=["--checkpoint-dir", "ckpt-b"], train_args=SHORT, log_name="b2.log"), a)
    jobs.codes["b2"] = run_to_end(jobs.b2)
    # Job A again, as after a requeue or a restart of rlsup.
    jobs.again = like(Cluster(root / "a", 2, extra=["--checkpoint-dir", "ckpt-a"], train_args=LONG,
                              log_name="a2.log"), a)
    jobs.codes["again"] = run_to_end(jobs.again)
    return jobs


def test_a_second_job_on_the_same_hosts_refuses_and_the_first_is_untouched(jobs: Jobs) -> None:
    a, d, e, b, c = jobs.a, jobs.d, jobs.e, jobs.b, jobs.c
    assert d is not None and e is not None and b is not None and c is not None, jobs.codes
    # A outlived every refusal (else B and C could have found the ports free): what follows is about A running.
    assert jobs.codes["a running after the refusals"] == {0: 1, 1: 1}, a.logs()
    assert d.returncode == 2 and "state_dir" in d.stderr and "is in use by rlsup job" in d.stderr, d.stderr
    assert e.returncode == 2 and "replica_dir" in e.stderr and "is in use by rlsup job" in e.stderr, e.stderr
    assert jobs.codes["b"] == {0: 2, 1: 2}, b.logs()
    for node in range(2):
        assert f"replication endpoint 127.0.0.1:{a.repl_ports[node]}" in b.log(node), b.log(node)
    assert jobs.codes["c"] == {0: 2, 1: 2}, c.logs()
    assert "coordinator port 9780 on 127.0.0.1 is taken by rlsup job" in c.log(0), c.log(0)
    assert "is hosted for rlsup job" in c.log(1) and "this node is job" in c.log(1), c.log(1)
    assert jobs.codes["a"] == {0: 0, 1: 0}, a.logs()
    for node in range(2):
        assert "rejoined" not in a.log(node) and "ignored" not in a.log(node), a.log(node)[-3000:]
    assert len(rlsup_resumes(a.log(0))) == 1  # one attempt: nothing of B, C or D reached it
    assert_same_weights(a.node_dir(0) / a.out_name, reference_weights(a.root.parent, 2, LONG))


def test_jobs_one_after_the_other_never_share_checkpoints(jobs: Jobs) -> None:
    a, b, again = jobs.a, jobs.b2, jobs.again
    assert b is not None and again is not None, jobs.codes
    assert jobs.codes["a"] == {0: 0, 1: 0}, a.logs()
    assert trainer_starts(a.log(0)) == [0]
    assert jobs.codes["b2"] == {0: 0, 1: 0}, b.logs()
    # Job A's replicas of its last step sit in the same replica directories; job B2 must not see them.
    assert rlsup_resumes(b.log(0)) == [None] and trainer_starts(b.log(0)) == [0], b.log(0)[-3000:]
    assert "starting fresh" in b.log(0)
    assert_same_weights(b.node_dir(0) / b.out_name, reference_weights(b.root.parent, 2, SHORT))
    for node in range(2):
        namespaces = sorted(p.name for p in (b.node_dir(node) / "replicas").iterdir() if not p.name.startswith("."))
        assert len(namespaces) == 2 and all(".node" in n for n in namespaces), namespaces  # one per job
    # Job A again, as after a requeue or a restart of rlsup: it resumes its own last step.
    assert jobs.codes["again"] == {0: 0, 1: 0}, again.logs()
    assert rlsup_resumes(again.log(0)) == [100] and trainer_starts(again.log(0)) == [100], again.log(0)[-3000:]
