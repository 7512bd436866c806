"""Half a clash (issue 32): two jobs started at the same instant on the same two "hosts" (127.0.0.1, each
node its own working directory standing for its machine), as users start them: default directories
(``.rlsup``, ``replicas``), the same peers and the same coordinator port, each job its own checkpoint
directory. Whichever node takes a host's locks first keeps that host; the jobs may each end up with
half. Every node must either run its job to a bit-identical end or exit 2 naming the clash, and no node
may wait out the rendezvous timeout (300 s here): every node has exited, or its job is training, within
:data:`FIRST_MINUTE_S` (a deadline on a wait, not a timed assertion).

Before the fix, job C's node 0 waited alone for a node 1 that had already refused. Now a node that
refuses tells its job's other nodes through the job's store (supervisor.cluster.clash_notice), and they exit 2
too. The default run does it once; ``--soak`` (tests/conftest.py's option) repeats it 10 times.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support.cluster import Cluster, assert_same_weights, reference_weights
from support.ports import free_ports
from support.waits import wait_for

SHORT = ["--steps", "9", "--checkpoint-every", "3", "--step-time", "0.05", "--keep-last", "100"]
FIRST_MINUTE_S = 60.0
CLASH_WORDS = ("is in use by rlsup job", "is hosted for rlsup job", "refused to start", "is taken by rlsup job")


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return reference_weights(tmp_path_factory.mktemp("ref"), 2, SHORT)


def two_jobs(root: Path) -> tuple[Cluster, Cluster]:
    """Jobs C and D in the same node directories, on the same ports and token."""
    c = Cluster(root, 2, extra=["--checkpoint-dir", "ckpt-c", "--metrics-port", "0"], train_args=SHORT,
                log_name="c.log", rendezvous_timeout=300)
    d = Cluster(root, 2, extra=["--checkpoint-dir", "ckpt-d", "--metrics-port", "0"], train_args=SHORT,
                log_name="d.log", rendezvous_timeout=300)
    (c.coord_port,) = free_ports(1)  # a shared port of its own (not 9780: other tests may run beside)
    d.repl_ports, d.coord_port, d.master_port, d.token = c.repl_ports, c.coord_port, c.master_port, c.token
    return c, d


def settled(job: Cluster, node: int) -> bool:
    """Exited, or past the round (its job launched)."""
    return job.procs[node].poll() is not None or "launching" in job.log(node)


def clash_once(root: Path, ref: dict) -> dict[str, list[int]]:
    """One run of the two jobs; each job's exit codes by node."""
    root.mkdir()
    c, d = two_jobs(root)
    jobs = {"C": c, "D": d}
    try:
        for node in range(2):  # as close to the same instant as Popen allows: C0, D0, C1, D1
            for job in jobs.values():
                job.start(node)
        wait_for(lambda: all(settled(job, n) for job in jobs.values() for n in range(2)), FIRST_MINUTE_S,
                 "every node to exit or its job to run (none may wait out the rendezvous timeout)")
        codes = {name: [job.procs[n].wait(timeout=240) for n in range(2)] for name, job in jobs.items()}
    except (AssertionError, subprocess.TimeoutExpired) as e:
        raise AssertionError(f"{e}\n--- C ---\n{c.logs()}\n--- D ---\n{d.logs()}") from e
    finally:
        for job in jobs.values():
            job.kill_all()
    for name, job in jobs.items():
        for node, code in enumerate(codes[name]):
            log = job.log(node)
            assert code in (0, 2), f"job {name} node {node} exited {code}:\n{log[-4000:]}"
            if code == 0:  # the job ran to its end: the final weights (rank 0's, on node 0) are the reference's
                assert codes[name] == [0, 0], f"job {name}: {codes[name]}\n{job.logs()}"
                assert_same_weights(job.node_dir(0) / job.out_name, ref)
            else:
                assert any(w in log for w in CLASH_WORDS), f"job {name} node {node} exited 2 without naming the " \
                                                           f"clash:\n{log[-4000:]}"
    return codes


def test_two_jobs_started_at_once_on_the_same_hosts(tmp_path: Path, ref: dict) -> None:
    clash_once(tmp_path / "run", ref)


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_two_jobs_started_at_once_ten_times(tmp_path: Path, ref: dict, request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("--soak", default=None):
        pytest.skip("soak: pass --soak MINUTES")
    for i in range(10):
        print(f"run {i}: exit codes of C's and D's nodes {clash_once(tmp_path / f'run{i}', ref)}", flush=True)
