"""A finished job stays finished (issue 41, item 7): a node cut off until after its job ended, its rank run to the
end by a spare, comes back to a store gone with the job. It learns that the job finished (node 0's record,
:class:`supervisor.cluster.spares.JobEnd`) and exits 0, never 75 (a requeue of a job that succeeded).

The record's rules are tested here in process (fast); the scenario end to end with real nodes (2 job nodes of 1
rank and 1 spare on 127.0.0.1, node 1's rlsup and everything under it SIGSTOPped until the others are done) is
:func:`test_a_node_cut_off_until_after_the_job_finished_exits_0`. What the batch script answers beside it is
tests/test_sbatch_spares.py."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

from support.cluster import job_subdir
from support.env import clean_env
from support.ports import free_port
from rlsup_format.manifest import manifest_name
from support.spares_cluster import SpareCluster, took_rank
from support.waits import wait_for
from supervisor import exit_codes
from supervisor.cluster.embedded_store import embedded_coordinator
from supervisor.job_identity import JobIdentity
from supervisor.transport.auth import load_secret
from supervisor.cluster.spares import (JobEnd, JobEnded, JobEndWatch, job_end_name)
from test_multinode_job_end import JOB, SECRET

# The fewest processes the scenario needs (the counts are not its subject): 2 job nodes of 1 rank each (node 0,
# which hosts the store and records the end, and the node cut off) and the spare that takes the cut-off rank.
JOB_NODES = 2
SPARE = 2
CUT_OFF = 1
# Long enough that node 1 is stopped mid-run on a loaded machine (stopped after the last step, it would leave the
# others in torchrun's exit barrier instead of a round a spare can take its rank in).
TRAIN_ARGS = ["--steps", "36", "--checkpoint-every", "3", "--step-time", "0.3", "--keep-last", "100"]


def test_a_join_waiting_for_a_lost_store_ends_when_the_job_s_end_is_found(tmp_path: Path) -> None:
    """The store (node 0's) goes after the first attempt; node 1's join waits for it in slices, reads node 0's
    record between them and ends with JobEnded long before rendezvous_timeout (600 s here)."""
    port = free_port()
    host = embedded_coordinator("127.0.0.1", port, JOB, SECRET, 0, 2, 10)
    node = embedded_coordinator("127.0.0.1", port, JOB, SECRET, 1, 2, 600)
    node.first_round = False  # the job has had attempts: a lost store is node 0's loss, not the first round's
    checkpoints = tmp_path / "shared-checkpoints"  # one directory for both nodes, as in the SLURM recipe
    watch = JobEndWatch.attach(node, checkpoint_dir=checkpoints, persistent=None, job=JOB)
    assert watch.over() is None
    JobEndWatch.attach(host, checkpoint_dir=checkpoints, persistent=None, job=JOB).record(0, 3)
    host.store.close()
    del host  # the embedded store goes with its host
    started = time.monotonic()
    with pytest.raises(JobEnded, match="node 0 recorded the job finished in attempt 3"):
        node.join(4)
    assert time.monotonic() - started < 120


def _saved(cluster: SpareCluster, node: int, step: int) -> bool:
    return (cluster.node_dir(node) / "checkpoints" / f"step_{step:09d}" / manifest_name(node)).exists()


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_a_node_cut_off_until_after_the_job_finished_exits_0(tmp_path: Path) -> None:
    """Node 1's rlsup, torchrun and rank are stopped mid-run (as a node cut off both ways: nothing it sends or
    answers gets through) until the job has finished on node 0 and the spare; then it goes on."""
    persistent = tmp_path / "persistent"  # a file system every node reads, as a persistent tier is
    # 2 job nodes of 1 rank, no warm launcher (each node would arm one it never uses: warm takeovers are
    # test_multinode_spares_e2e.py's), no Flight Recorder (its buffer 0, as a user may set it: the hang that ends
    # attempt 0 is the cut-off, not the subject, and each node's analyser would import torch once more; the
    # verdict across nodes is test_flight_recorder_multinode_e2e.py's)
    cluster = SpareCluster(tmp_path, train_args=TRAIN_ARGS, warm_launcher=False, job_nodes=JOB_NODES, ranks_per_node=1,
                           env=clean_env(TORCH_FR_BUFFER_SIZE="0"),
                           extra=["--persistent-dir", str(persistent), "--heartbeat-timeout", "10"])
    frozen: list[psutil.Process] = []
    try:
        for node in range(cluster.nodes):
            cluster.start(node)
        wait_for(lambda: _saved(cluster, CUT_OFF, 6), 300, "node 1's step 6 saved", interval=0.05)
        attempt = cluster.state(CUT_OFF).get("attempt")
        frozen = []
        for p in _tree(cluster.procs[CUT_OFF].pid):
            try:
                p.send_signal(signal.SIGSTOP)
                frozen.append(p)
            except psutil.NoSuchProcess:
                pass  # a short-lived child (a tier copy's fork) that ended between the listing and the signal
        # The job ends with node 0 (its store with it); the others may still be draining their replication
        wait_for(lambda: cluster.procs[0].poll() is not None, 300, "node 0 to end the job")
        assert cluster.procs[0].returncode == 0 and took_rank(cluster.log(SPARE)) == CUT_OFF, cluster.logs()
        for p in frozen:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        frozen = []
        code = cluster.procs[CUT_OFF].wait(timeout=90)  # before rendezvous_timeout (120 s here) for a store gone for good
        others = cluster.wait_all(timeout=120)
        assert {n: others[n] for n in (0, SPARE)} == {0: 0, SPARE: 0}, cluster.logs()
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        for p in frozen:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        cluster.kill_all()
    assert code == exit_codes.OK, cluster.log(CUT_OFF)[-4000:]
    state = cluster.state(CUT_OFF)
    assert state["exit_code"] == exit_codes.OK and state["attempt"] == attempt, state  # nothing launched after
    job = JobIdentity(job_subdir(persistent).name, "test")  # the tier's directory is named for the job
    end = JobEnd.open((job_subdir(persistent) / job_end_name(job)).read_bytes(), job, load_secret(cluster.token))
    assert end is not None and end.node == 0 and end.attempt == cluster.state(0)["attempt"] > attempt, (end, attempt)
    assert "finished without this node" in cluster.log(CUT_OFF), cluster.log(CUT_OFF)[-4000:]
