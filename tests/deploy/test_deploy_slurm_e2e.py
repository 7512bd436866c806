"""deploy/slurm/rlsup.sbatch on a real one-node SLURM cluster started here (munged, slurmctld, slurmd
from Debian's packages, all on 127.0.0.1, config in a temporary directory).

Two jobs of examples/train_tiny.py under torchrun run at once:
  * `scontrol requeue` mid-run: SLURM kills the job and starts the batch script again; the new rlsup
    resumes from the newest checkpoint and the run ends with the same weights as an uninterrupted one.
  * a preemption (`scancel --batch --signal=USR1`, what `--signal=B:USR1@120` sends): the script
    relays SIGUSR1 to rlsup, the trainer saves, rlsup exits 75, the script runs `scontrol requeue`.
A requeued job waits AuthInfo cred_expire (120 s by default) before it runs again; the test lowers it.
"""

from __future__ import annotations


import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from support.env import ROOT, clean_env
from support.ports import free_ports
from support.slurm_cluster import NEEDS_SLURM, Cluster, running_cluster
from support.waits import wait_for

SBATCH = ROOT / "deploy" / "slurm" / "rlsup.sbatch"
TRAIN = ROOT / "examples" / "train_tiny.py"
TRAIN_ARGS = ["--steps", "40", "--checkpoint-every", "5", "--step-time", "0.15"]

pytestmark = NEEDS_SLURM


def test_sbatch_script_syntax() -> None:
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = SBATCH.read_text()
    for directive in ("--requeue", "--signal=B:USR1@120", "--open-mode=append"):
        assert f"#SBATCH {directive}" in text
    assert "--ntasks-per-node=1 --kill-on-bad-exit=0" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with running_cluster("rlsup-slurm-") as c:
        yield c


def submit(cluster: Cluster, job_dir: Path, master_port: int, **extra_env: str) -> str:
    job_dir.mkdir(parents=True)
    # No warm launcher (RLSUP_WARM_LAUNCHER, as a user sets any key): no rlsup here restarts its job, SLURM's requeue
    # starts a new one, so each would arm one it never uses (CONTRIBUTING.md "Suite time")
    env = clean_env(SLURM_CONF=str(cluster.conf), SUPERVISOR=str(Path(sys.executable).parent / "rlsup"),
                    TORCHRUN=f"{sys.executable} -m torch.distributed.run", MASTER_PORT=str(master_port),
                    JOB_DIR=str(job_dir), RLSUP_WARM_LAUNCHER="false", **extra_env)
    r = subprocess.run(["sbatch", "--parsable", f"--chdir={job_dir}", str(SBATCH), str(TRAIN), *TRAIN_ARGS,
                        "--out", str(job_dir / "final.pt")], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def newest_step(job_dir: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in (job_dir / "checkpoints").glob("step_*")] if (
        job_dir / "checkpoints").exists() else []
    return max(steps, default=0)


def output(job_dir: Path, job: str) -> str:
    path = job_dir / f"rlsup-train-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def reference_sha(tmp: Path) -> str:
    r = subprocess.run([sys.executable, str(TRAIN), *TRAIN_ARGS, "--step-time", "0", "--checkpoint-dir",
                        str(tmp / "ref"), "--out", str(tmp / "ref.pt")], capture_output=True, text=True, env=clean_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    return re.search(r"weights sha256 (\w+)", r.stdout + r.stderr).group(1)


def test_requeue_and_preemption_resume_from_checkpoint(cluster: Cluster, tmp_path: Path) -> None:
    port_a, port_b = free_ports(2)
    dir_a, dir_b = tmp_path / "requeued", tmp_path / "preempted"
    dir_a.parent.chmod(0o755)
    job_a = submit(cluster, dir_a, port_a)
    job_b = submit(cluster, dir_b, port_b)
    try:
        # A: `scontrol requeue` once a checkpoint exists (SLURM kills the step, then reruns the script).
        wait_for(lambda: newest_step(dir_a) >= 10, 180, "job A's checkpoint of step 10", interval=0.2)
        saved_a = newest_step(dir_a)
        cluster.run("scontrol", "requeue", job_a, check=True)
        # B: the preemption warning SLURM sends the batch shell with --signal=B:USR1@120.
        wait_for(lambda: newest_step(dir_b) >= 10, 180, "job B's checkpoint of step 10", interval=0.2)
        cluster.run("scancel", "--batch", "--signal=USR1", job_b, check=True)

        ref = reference_sha(tmp_path)  # meanwhile (the requeued jobs wait cred_expire)
        for job in (job_a, job_b):
            wait_for(lambda j=job: cluster.state(j)[0] in ("COMPLETED", "FAILED", "CANCELLED"), 240,
                     f"job {job} to finish after its requeue", interval=0.5)
    except BaseException:
        print(output(dir_a, job_a), output(dir_b, job_b), cluster.logs())
        raise
    for job, job_dir in ((job_a, dir_a), (job_b, dir_b)):
        out = output(job_dir, job)
        assert cluster.state(job)[0] == "COMPLETED", out
        assert re.search(r"Restarts=1\b", cluster.run("scontrol", "show", "job", job).stdout)
        # --open-mode=append: both runs of the batch script in one file
        assert f"job {job} restart 0:" in out and f"job {job} restart 1:" in out, out
        # attempt 0 of the new rlsup, or attempt 1 when SLURM's KillWait ended the old rlsup before it
        # recorded its stop (it then continues the numbering: "a previous rlsup died during attempt 0")
        resumed = re.findall(r"\[rlsup\] attempt \d+: launching .* from step (\d+)", out)
        assert len(resumed) == 1 and int(resumed[0]) >= 10, out
        assert "[train_tiny] done at step 40" in out and "[rlsup] succeeded" in out, out
        assert re.findall(r"weights sha256 (\w+)", out)[-1] == ref, "resumed run's weights differ from an uninterrupted run"
    out_a, out_b = output(dir_a, job_a), output(dir_b, job_b)
    assert "DUE TO JOB REQUEUE" in out_a and "rlsup exited 75" not in out_a
    assert int(re.search(r"from step (\d+)", out_a).group(1)) >= saved_a
    assert "relaying SIGUSR1 to rlsup" in out_b and "[rlsup] preempted" in out_b, out_b
    assert "rlsup exited 75" in out_b and f"requeueing job {job_b}" in out_b, out_b


def test_unhealthy_node_is_excluded_from_the_requeue(cluster: Cluster, tmp_path: Path) -> None:
    """pre_launch_check fails: rlsup exits 77 naming the node, the script requeues the job with that node
    in ExcNodeList. With one node the requeued job can only wait (as far as one node allows)."""
    job_dir = tmp_path / "sick"
    tmp_path.chmod(0o755)
    job = submit(cluster, job_dir, free_ports(1)[0], RLSUP_PRE_LAUNCH_CHECK="echo 'ECC errors on GPU 0' >&2; exit 1")
    try:
        wait_for(lambda: "requeueing job" in output(job_dir, job), 180, "the script to requeue after exit 77",
                 interval=0.3)
        def excluded_and_released() -> str | None:
            shown = cluster.run("scontrol", "show", "job", job).stdout
            held = re.search(r"Priority=0\b|JobHeld", shown)
            return shown if re.search(r"ExcNodeList=(?!\(null\))\S+", shown) and not held else None

        shown = wait_for(excluded_and_released, 120, "the requeued job to carry ExcNodeList, released", interval=0.5)
        assert cluster.state(job)[0] == "PENDING", shown  # its only node is excluded: it can only wait
        out = output(job_dir, job)
    finally:
        cluster.run("scancel", job)
    node = re.search(r"\[rlsup\] .*node (\S+) is unhealthy: pre_launch_check exited 1 \(ECC errors on GPU 0\)", out)
    assert node, out
    assert "rlsup exited 77" in out and f"unhealthy node(s) {node.group(1)}: requeueing job {job}" in out, out
    assert re.search(r"ExcNodeList=(\S+)", shown).group(1) == node.group(1), shown
    assert (job_dir / "rlsup-state" / node.group(1) / "unhealthy_nodes").read_text() == node.group(1) + "\n"
