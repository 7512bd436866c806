"""deploy/slurm/rlsup.sbatch with a spare node under a real SLURM: 4 nodes (4 slurmd on 127.0.0.1,
tests/support/slurm_cluster.py), ``RLSUP_SPARES=1 sbatch --nodes=4 --no-kill``: the job runs on 3 nodes of
one rank each, the fourth waits as a spare. Node sn3's rlsup (node rank 2) is SIGKILLed once its step 6
part is replicated: the spare takes node rank 2, every node resumes from the same step, the job ends
COMPLETED without a requeue and with the weights of an uninterrupted run, and the script's answer is the
nodes' 0, not srun's 137 for the lost node.

Long (a 4-node job on a loaded 2-core machine, about 2 minutes): it runs with the soak
(``pytest tests/deploy/test_deploy_slurm_spares_e2e.py --soak 1``)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Iterator

import pytest

from support.cluster import assert_same_weights, reference_weights
from support.env import ROOT
from support.slurm_cluster import NEEDS_SLURM, Cluster, job_output, replicated, running_cluster, submit_recipe
from support.waits import wait_for

TRAIN = ROOT / "examples" / "train_tiny.py"
JOB_NODES, SPARES = 3, 1
TRAIN_ARGS = ["--steps", "30", "--checkpoint-every", "3", "--step-time", "0.15", "--keep-last", "100"]

pytestmark = [pytest.mark.soak, *NEEDS_SLURM]



@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with running_cluster("rlsup-slurm-spares-", nodes=JOB_NODES + SPARES) as c:
        yield c


def submit(cluster: Cluster, job_dir: Path) -> str:
    return submit_recipe(cluster, job_dir, JOB_NODES + SPARES, [str(TRAIN), *TRAIN_ARGS, "--out", str(job_dir / "final.pt")],
                         RLSUP_SPARES=str(SPARES), RLSUP_SPARE_TAKEOVER_S="1", RLSUP_HEARTBEAT_TIMEOUT="60")


def test_a_spare_takes_a_lost_node_s_rank_and_the_job_completes(cluster: Cluster, tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    job_dir = tmp_path / "job"
    job = submit(cluster, job_dir)
    lost, holder = cluster.node_names[2], cluster.node_names[0]  # node rank 2 replicates to node rank 0
    try:
        wait_for(lambda: replicated(job_dir, holder, 2, 6), 240, f"{lost}'s step 6 part replicated to {holder}",
                 interval=0.1)
        pid = int((job_dir / "rlsup-pids" / job / f"{lost}.pid").read_text())
        os.kill(pid, signal.SIGKILL)  # the node's rlsup; its torchrun and ranks die with it
        # lost mid-run (a node lost after the last step leaves the others in torchrun's exit barrier instead)
        assert "done at step" not in job_output(job_dir, job), job_output(job_dir, job)
        ref = reference_weights(tmp_path, nodes=JOB_NODES, train_args=TRAIN_ARGS)  # meanwhile
        wait_for(lambda: cluster.state(job)[0] in ("COMPLETED", "FAILED", "CANCELLED"), 300,
                 f"job {job} to finish", interval=0.5)
    except BaseException:
        print(job_output(job_dir, job), cluster.logs())
        raise
    out = job_output(job_dir, job)
    shown = cluster.run("scontrol", "show", "job", job).stdout
    assert cluster.state(job)[0] == "COMPLETED" and re.search(r"Restarts=0\b", shown), out + shown
    assert "4 node(s) (3 for the job, the last 1 spare)" in out, out
    assert re.search(r"spare \S+: took node rank 2 ", out), out
    assert f"lost node(s): {lost} (srun exited 137); the other nodes exited 0" in out, out
    assert "rlsup exited 0" in out and "requeueing" not in out, out
    resumed = [int(s) for s in re.findall(r"attempt 1: launching .* from step (\d+)", out)]
    assert len(resumed) == JOB_NODES and len(set(resumed)) == 1 and resumed[0] >= 6, out  # every node, one step
    assert len(re.findall(r"\[rlsup\] succeeded", out)) == JOB_NODES, out
    assert_same_weights(job_dir / "final.pt", ref)
    codes = {p.stem: p.read_text().strip() for p in (job_dir / "rlsup-pids" / job).glob("*.rc")}
    assert codes == {**{n: "0" for n in cluster.node_names}, lost: "137"}, codes
