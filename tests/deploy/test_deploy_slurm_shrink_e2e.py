"""deploy/slurm/rlsup.sbatch shrinking a job under a real SLURM: 3 nodes (3 slurmd on 127.0.0.1,
tests/support/slurm_cluster.py), ``RLSUP_MIN_NODES=2 sbatch --nodes=3 --no-kill``, one rank per node, no spare.
The trainer is tests/jobs/world_change_job.py (DDP, torch backend: its saves are marked resizable; the global
batch is kept by gradient accumulation), as the 127.0.0.1 shrink harness runs it (tests/support/shrink_cluster.py),
here under the torchrun the script types (static rendezvous, ``--nnodes=3 --node-rank=$SLURM_NODEID``). Its first
attempt holds after its save at step HELD; node sn3's rlsup (node rank 2) is SIGKILLed once its HELD part is
replicated, then the hold is released. The two nodes left go on without it from HELD ("continued on 2 of 3 nodes"),
the job ends COMPLETED without a requeue, the script's answer is the nodes' 0 (not srun's 137 for the lost node),
and the final weights and the samples consumed are those of the same job without rlsup: 3 ranks to HELD, then 2
ranks from that save to the end.

Long (a 3-node job on a loaded 2-core machine, about 2 minutes): a soak test
(``pytest tests/deploy/test_deploy_slurm_shrink_e2e.py --soak 1``)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Iterator

import pytest

from support.incidents import incidents, read_state
from support.slurm_cluster import NEEDS_SLURM, Cluster, job_output, replicated, running_cluster, submit_recipe
from support.shrink_cluster import id_logs_in
from support.waits import wait_for
from support.world_phases import JOB, Phase, check_data_order, consumed, consumed_from, run_chain, same_state

JOB_NODES, MIN_NODES = 3, 2
HELD = 6  # the first attempt's save it holds after: the step the shrunk job continues from
UNTIL = 12  # past two epoch ends (5 steps an epoch), the last one partial
SAVE_AT = (3, HELD, 9)  # 9: the shrunk job saves too
CONTINUED = f"continued on {MIN_NODES} of {JOB_NODES} nodes from step {HELD}"

pytestmark = [pytest.mark.soak, *NEEDS_SLURM]



@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with running_cluster("rlsup-slurm-shrink-", nodes=JOB_NODES) as c:
        yield c


def trainer_args(job_dir: Path) -> list[str]:
    """world_change_job.py as the shrink harness runs it, its checkpoints where the script points rlsup
    (``$JOB_DIR/checkpoints``), its id logs tagged by attempt, held after HELD until ``release-hold`` exists."""
    return [JOB, "--model", "ddp", "--backend", "torch", "--checkpoint-dir", str(job_dir / "checkpoints"),
            "--until", str(UNTIL), "--save-at", ",".join(map(str, SAVE_AT)), "--log-dir", str(job_dir / "logs"),
            "--tag", "a", "--attempt-tag", "--hold-at", str(HELD), "--hold-file", str(job_dir / "release-hold"),
            "--out", str(job_dir / "final.pt")]


def submit(cluster: Cluster, job_dir: Path) -> str:
    return submit_recipe(cluster, job_dir, JOB_NODES, trainer_args(job_dir), RLSUP_MIN_NODES=str(MIN_NODES),
                         RLSUP_SPARE_TAKEOVER_S="2", OMP_NUM_THREADS="1",
                         RLSUP_HEARTBEAT_TIMEOUT="600")  # the trainer sends none, and rank 0 holds at HELD


def saved_everywhere(job_dir: Path, step: int) -> bool:
    """Every rank's part of ``step`` is in the shared checkpoint directory."""
    return all((job_dir / "checkpoints" / f"step_{step:09d}" / f"manifest.rank_{rank:05d}.json").exists()
               for rank in range(JOB_NODES))


def test_a_lost_node_without_spare_shrinks_the_job_and_it_completes(cluster: Cluster, tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    job_dir = tmp_path / "job"
    job = submit(cluster, job_dir)
    lost, holder = cluster.node_names[2], cluster.node_names[0]  # node rank 2 replicates to node rank 0
    # The same job without rlsup: 3 ranks to HELD, then 2 ranks from that save to the end.
    reference = (Phase(JOB_NODES, HELD, tuple(s for s in SAVE_AT if s <= HELD), range(1, HELD + 1)),
                 Phase(MIN_NODES, UNTIL, tuple(s for s in SAVE_AT if s > HELD), range(HELD + 1, UNTIL + 1)))
    try:
        wait_for(lambda: saved_everywhere(job_dir, HELD) and replicated(job_dir, holder, 2, HELD), 300,
                 f"step {HELD} saved and {lost}'s part replicated to {holder}", interval=0.1)
        wait_for(lambda: f"HOLDING after step {HELD}" in job_output(job_dir, job), 60, "rank 0 holding")
        pid = int((job_dir / "rlsup-pids" / job / f"{lost}.pid").read_text())
        os.kill(pid, signal.SIGKILL)  # the node's rlsup; its torchrun and rank die with it
        (job_dir / "release-hold").touch()  # rank 0 goes on into a collective with the lost rank
        run_chain(tmp_path / "reference", reference, "ddp", "torch")  # meanwhile
        wait_for(lambda: cluster.state(job)[0] in ("COMPLETED", "FAILED", "CANCELLED"), 420,
                 f"job {job} to finish", interval=0.5)
    except BaseException:
        print(job_output(job_dir, job), cluster.logs())
        raise
    out = job_output(job_dir, job)
    shown = cluster.run("scontrol", "show", "job", job).stdout
    assert cluster.state(job)[0] == "COMPLETED" and re.search(r"Restarts=0\b", shown), out + shown
    assert f"{JOB_NODES} node(s), going on with at least {MIN_NODES}," in out, out
    assert f"lost node(s): {lost} (srun exited 137); the other nodes exited 0" in out, out
    assert "rlsup exited 0" in out and "requeueing" not in out, out
    # both nodes left say what the job went on with, and resumed from HELD (the lost node never launched again)
    assert len(re.findall(re.escape(CONTINUED), out)) >= MIN_NODES, out
    resumed = [int(s) for s in re.findall(r"attempt 1: launching .* from step (\d+)", out)]
    assert resumed == [HELD] * MIN_NODES, out
    assert f"WORLD_CHANGE {HELD} {JOB_NODES} {MIN_NODES}" in out, out
    assert len(re.findall(r"\[rlsup\] succeeded", out)) == MIN_NODES, out
    codes = {p.stem: p.read_text().strip() for p in (job_dir / "rlsup-pids" / job).glob("*.rc")}
    assert codes == {**{n: "0" for n in cluster.node_names}, lost: "137"}, codes
    for node in cluster.node_names[:MIN_NODES]:  # the failure's incident says it; state.json the job's size now
        state_dir = job_dir / "rlsup-state" / node
        assert [i.get("world") for i in incidents(state_dir)] == [CONTINUED], (node, out)
        assert (read_state(state_dir)["world_nodes"], read_state(state_dir)["job_nodes"]) == (MIN_NODES, JOB_NODES)

    # The final weights, bit for bit, and the samples consumed: the first attempt's up to HELD (what it took after
    # HELD died with it and was redone), then the shrunk attempt's, every sample of each epoch once, in order.
    assert same_state(job_dir / "final.pt", tmp_path / "reference" / "final.pt") == []
    check_data_order(consumed(tmp_path / "reference", reference), UNTIL)
    logs = id_logs_in([job_dir])
    assert list(logs) == [0, 1], {a: [p.name for p in f] for a, f in logs.items()}
    assert min(int(line.split()[0]) for p in logs[1] for line in p.read_text().splitlines()) == HELD + 1, logs[1]
    check_data_order(consumed_from([logs[0], logs[1]], reference), UNTIL)
