"""deploy/slurm/rlsup.sbatch with spare nodes (RLSUP_SPARES=k on an allocation of N + k nodes), run by real bash
with SLURM's srun/scontrol and rlsup replaced by recorders (tests/support/fake_slurm.py): the step it asks for
(--no-kill with spares), the command and environment every node's rlsup gets (torchrun --nnodes N, the node
rank SLURM_NODEID, peers listing all N + k nodes), and what the script answers when a node was lost. The real
cluster runs are tests/deploy/test_deploy_slurm_e2e.py and tests/deploy/test_deploy_slurm_spares_e2e.py."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from support.env import ROOT, clean_env
from support.fake_slurm import FakeSlurm, install
from support.waits import wait_for
from supervisor import exit_codes

SBATCH = ROOT / "deploy" / "slurm" / "rlsup.sbatch"


def nodes(n: int) -> list[str]:
    return [f"n{i}" for i in range(1, n + 1)]


def batch_env(fake: FakeSlurm, job_dir: Path, allocated: int, **extra: str) -> dict[str, str]:
    """What SLURM gives the batch script of job 42 on ``allocated`` nodes, with the fakes first on PATH."""
    return clean_env(PATH=f"{fake.bin}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_LOG=str(fake.log),
                     SLURM_JOB_ID="42", SLURM_JOB_NAME="rlsup-train", SLURM_JOB_NUM_NODES=str(allocated),
                     SLURM_JOB_NODELIST=",".join(nodes(allocated)), SLURM_SUBMIT_DIR=str(job_dir),
                     JOB_DIR=str(job_dir), SUPERVISOR=fake.rlsup, TORCHRUN="torchrun", **extra)


def run_batch(tmp_path: Path, allocated: int, **extra: str) -> tuple[FakeSlurm, subprocess.CompletedProcess]:
    fake = install(tmp_path / "fake")
    r = subprocess.run(["bash", str(SBATCH), "train.py", "--lr", "0.1"], capture_output=True, text=True,
                       env=batch_env(fake, tmp_path / "job", allocated, **extra), timeout=60)
    return fake, r


def torchrun_args(argv: list[str]) -> list[str]:
    return argv[argv.index("--") + 1:]


def run_elastic_batch(tmp_path: Path, allocated: int, says: str, **extra: str) -> FakeSlurm:
    """:func:`run_batch` of a job that may lose a node (spares, min_nodes): it ends 0, says ``says``, and its one step
    runs on every allocated node and outlives a failed one (--no-kill)."""
    fake, r = run_batch(tmp_path, allocated, **extra)
    assert r.returncode == 0, r.stdout + r.stderr
    (step,) = fake.sruns()
    assert "--no-kill" in step["options"] and f"--nodes={allocated}" in step["options"], step
    assert says in r.stdout, r.stdout
    return fake


def test_spares_run_the_job_on_n_and_every_node_gets_peers_of_n_plus_k(tmp_path: Path) -> None:
    # RLSUP_SPARES as typed: a leading zero is still decimal
    fake = run_elastic_batch(tmp_path, 5, "5 node(s) (4 for the job, the last 1 spare)", RLSUP_SPARES="01")
    for rank, name in enumerate(nodes(5)):
        seen = fake.node(name)
        assert seen["argv"][:3] == ["run", "--state-dir", str(tmp_path / "job" / "rlsup-state" / name)], seen
        assert torchrun_args(seen["argv"]) == [
            "torchrun", "--nnodes=4", f"--node-rank={rank}", "--nproc-per-node=1", "--master-addr=n1",
            "--master-port=29500", "train.py", "--lr", "0.1"], seen  # the spare's rank 4: rlsup rewrites it
        assert seen["env"] == {"RLSUP_PEERS": "n1:9779,n2:9779,n3:9779,n4:9779,n5:9779", "RLSUP_SPARES": "1",
                               "RLSUP_MIN_NODES": None, "RLSUP_REPLICA_DIR": str(tmp_path / "job" / "rlsup-replicas" / name),
                               "MASTER_ADDR": "n1", "MASTER_PORT": "29500", "SLURM_NODEID": str(rank)}, seen
        assert (tmp_path / "job" / "rlsup-pids" / "42" / f"{name}.rc").read_text() == "0\n"


def test_without_spares_the_step_and_the_command_are_as_before(tmp_path: Path) -> None:
    fake, r = run_batch(tmp_path, 3)
    assert r.returncode == 0, r.stdout + r.stderr
    (step,) = fake.sruns()
    assert step["options"] == ["--nodes=3", "--ntasks-per-node=1", "--kill-on-bad-exit=0"], step
    assert "for the job" not in r.stdout, r.stdout
    seen = fake.node("n3")
    assert "--nnodes=3" in torchrun_args(seen["argv"]) and "--node-rank=2" in torchrun_args(seen["argv"])
    assert seen["env"]["RLSUP_SPARES"] is None and seen["env"]["RLSUP_PEERS"] == "n1:9779,n2:9779,n3:9779"
    assert seen["env"]["RLSUP_MIN_NODES"] is None


def test_without_spares_a_killed_node_is_srun_s_answer_as_before(tmp_path: Path) -> None:
    fake, r = run_batch(tmp_path, 3, FAKE_ENDS="n2=kill")
    assert r.returncode == 137, r.stdout + r.stderr
    assert "rlsup exited 137" in r.stdout and "lost node" not in r.stdout, r.stdout
    assert not any(c.startswith("requeue") for c in fake.scontrol_calls())


@pytest.mark.parametrize("how", ["FAKE_ENDS", "FAKE_LOST"])
@pytest.mark.parametrize(("allocated", "elastic", "lost"), [(4, {"RLSUP_SPARES": "1"}, "n2"),
                                                           (3, {"RLSUP_MIN_NODES": "2"}, "n3")],
                         ids=["spare", "min_nodes"])
def test_a_node_lost_while_the_others_finished_ends_the_job_as_succeeded(tmp_path: Path, how: str, allocated: int,
                                                                         elastic: dict[str, str], lost: str) -> None:
    """SIGKILLed (its task's shell writes 137) or gone with its node (nothing written): the others' 0 counts, whether
    a spare finished the lost node's part or the nodes left finished without it (min_nodes)."""
    fake, r = run_batch(tmp_path, allocated, **elastic, **{how: f"{lost}=kill" if how == "FAKE_ENDS" else lost})
    assert r.returncode == 0 and "rlsup exited 0" in r.stdout, r.stdout + r.stderr
    assert f"lost node(s): {lost}" in r.stdout and "the other nodes exited 0" in r.stdout, r.stdout
    assert not any(c.startswith("requeue") for c in fake.scontrol_calls())


def test_a_node_lost_with_no_spare_left_requeues_the_job(tmp_path: Path) -> None:
    """The survivors gave up waiting for the lost node (rendezvous_timeout: exit 1): requeue, as SLURM would."""
    fake, r = run_batch(tmp_path, 4, RLSUP_SPARES="1", FAKE_LOST="n3", FAKE_ENDS="n1=1,n2=1,n4=1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "could not go on without the lost node(s): requeueing job 42" in r.stdout, r.stdout
    assert "requeue 42" in fake.scontrol_calls()


def test_a_node_a_spare_replaced_exits_77_beside_a_job_that_succeeded_no_requeue(tmp_path: Path) -> None:
    """n2 failed pre_launch_check (or came back after its rank was taken): 77; the spare ran its rank and every
    other node exited 0, which rlsup does only when the job succeeded."""
    fake, r = run_batch(tmp_path, 4, RLSUP_SPARES="1", FAKE_ENDS="n2=77")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the job succeeded; node(s) n2 exited 77 after a spare took their rank" in r.stdout, r.stdout
    assert fake.scontrol_calls() and not any(c.startswith(("requeue", "update")) for c in fake.scontrol_calls())


@pytest.mark.parametrize("late", ["0", "75", "1"])
def test_a_node_cut_off_until_after_the_job_ended_never_requeues_it(tmp_path: Path, late: str) -> None:
    """Issue 41: n3 was cut off, the spare n4 ran its rank and the job finished; n3 came back to a store gone with
    the job. rlsup now exits 0 there (a record says the job finished: tests/cluster/test_multinode_job_end.py); an rlsup
    that asked for a requeue (75), or gave up waiting (1), beside the others' 0 must not requeue a finished job."""
    fake, r = run_batch(tmp_path, 4, RLSUP_SPARES="1", FAKE_ENDS=f"n3={late}")
    assert r.returncode == 0 and "rlsup exited 0" in r.stdout, r.stdout + r.stderr
    assert not any(c.startswith(("requeue", "update")) for c in fake.scontrol_calls()), fake.scontrol_calls()
    if late != "0":
        assert f"the job succeeded (a node exited 0); not requeueing it for node(s) n3 ({late})" in r.stdout, r.stdout


def test_a_success_beside_a_lost_node_and_a_requeue_request_is_not_requeued(tmp_path: Path) -> None:
    fake, r = run_batch(tmp_path, 4, RLSUP_SPARES="1", FAKE_LOST="n2", FAKE_ENDS="n3=75")
    assert r.returncode == 0 and "rlsup exited 0" in r.stdout, r.stdout + r.stderr
    assert "lost node(s): n2" in r.stdout and "requeueing job" not in r.stdout, r.stdout
    assert not any(c.startswith("requeue") for c in fake.scontrol_calls()), fake.scontrol_calls()


@pytest.mark.parametrize("ends,answer", [("n1=76,n2=1,n3=1", 76), ("n1=1,n2=1,n3=1", 1)])
def test_nodes_that_gave_up_beside_an_idle_spare_are_not_a_success(tmp_path: Path, ends: str, answer: int) -> None:
    """Review finding (issue 41): the job's nodes gave up (76, 1) and the idle spare n4 found the store and every
    node gone. It exited 0 then, and the script (once a node exited 0, the answer is 0) said the job succeeded. A
    spare that saw no sign of the job's end now exits 1 (tests/cluster/test_spare_first_connect_e2e.py): the nodes' answer
    stands, nothing is requeued for a job that makes no progress, and no success is claimed."""
    idle_spare = exit_codes.FAILED
    fake, r = run_batch(tmp_path, 4, RLSUP_SPARES="1", FAKE_ENDS=f"{ends},n4={idle_spare}")
    assert r.returncode == answer and f"rlsup exited {answer}" in r.stdout, r.stdout + r.stderr
    assert "succeeded" not in r.stdout, r.stdout
    assert not any(c.startswith(("requeue", "update")) for c in fake.scontrol_calls()), fake.scontrol_calls()


def test_with_spares_77_without_a_success_still_requeues_without_the_node(tmp_path: Path) -> None:
    fake, r = run_batch(tmp_path, 4, RLSUP_SPARES="1", FAKE_ENDS="n1=77,n2=77,n3=1,n4=75")
    assert r.returncode == 0 and "rlsup exited 77" in r.stdout, r.stdout + r.stderr
    assert "requeue 42" in fake.scontrol_calls()  # none named in unhealthy_nodes: a plain requeue


def test_with_spares_no_progress_is_still_not_requeued(tmp_path: Path) -> None:
    fake, r = run_batch(tmp_path, 4, RLSUP_SPARES="1", FAKE_LOST="n4", FAKE_ENDS="n1=76,n2=76,n3=76")
    assert r.returncode == 76, r.stdout + r.stderr
    assert not any(c.startswith("requeue") for c in fake.scontrol_calls())


def test_peers_at_node_addresses_shared_by_several_nodes_get_their_own_ports(tmp_path: Path) -> None:
    fake, r = run_batch(tmp_path, 3, RLSUP_SPARES="1", PEER_ADDR="nodeaddr", FAKE_NODEADDR="127.0.0.1",
                        RLSUP_REPLICATION_PORT="7000")
    assert r.returncode == 0, r.stdout + r.stderr
    seen = fake.node("n2")
    assert seen["env"]["RLSUP_PEERS"] == "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002", seen
    assert seen["env"]["MASTER_ADDR"] == "127.0.0.1" and "--master-addr=127.0.0.1" in torchrun_args(seen["argv"])


def test_distinct_node_addresses_keep_one_port(tmp_path: Path) -> None:
    fake, r = run_batch(tmp_path, 3, PEER_ADDR="nodeaddr")
    assert r.returncode == 0, r.stdout + r.stderr
    assert fake.node("n1")["env"]["RLSUP_PEERS"] == "10.0.0.1:9779,10.0.0.2:9779,10.0.0.3:9779"


@pytest.mark.parametrize(("allocated", "extra", "says"), [
    (4, {"RLSUP_SPARES": "one"}, "RLSUP_SPARES=one: expected a whole number of spare nodes"),
    (3, {"RLSUP_SPARES": "2"}, "RLSUP_SPARES=2 of 3 allocated node(s) leaves 1 for the job"),
    (3, {"PEER_ADDR": "ip"}, "PEER_ADDR=ip: expected name or nodeaddr"),
    (3, {"RLSUP_MIN_NODES": "two"}, "RLSUP_MIN_NODES=two: expected a whole number of nodes"),
    (3, {"RLSUP_MIN_NODES": "-1"}, "RLSUP_MIN_NODES=-1: expected a whole number of nodes"),
    (3, {"RLSUP_MIN_NODES": "4"}, "RLSUP_MIN_NODES=4 is more than the job's 3 node(s) (3 allocated, 0 spare)"),
    (4, {"RLSUP_SPARES": "1", "RLSUP_MIN_NODES": "4"},
     "RLSUP_MIN_NODES=4 is more than the job's 3 node(s) (4 allocated, 1 spare)"),
    (1, {"RLSUP_MIN_NODES": "1"}, "RLSUP_MIN_NODES=1 on a single node: a job of one node cannot shrink"),
])
def test_bad_spares_settings_exit_2_before_any_step(tmp_path: Path, allocated: int, extra: dict[str, str],
                                                   says: str) -> None:
    fake, r = run_batch(tmp_path, allocated, **extra)
    assert r.returncode == 2 and says in r.stderr, r.stdout + r.stderr
    assert fake.sruns() == []


@pytest.mark.parametrize("elastic", [{"RLSUP_SPARES": "1"}, {"RLSUP_MIN_NODES": "2"}], ids=["spare", "min_nodes"])
def test_preemption_is_relayed_to_the_nodes_left_after_a_loss(tmp_path: Path, elastic: dict[str, str]) -> None:
    """SLURM drops a failed node from a --no-kill job: the relay asks for the job's nodes now, and every rlsup
    left (the spare too) gets SIGUSR1 at the pid the script recorded; 75 from them requeues the job. The same
    with no spare where the nodes left go on without the lost one (min_nodes)."""
    fake = install(tmp_path / "fake")
    env = batch_env(fake, tmp_path / "job", 4, **elastic, FAKE_LOST="n2", FAKE_JOB_NODES="n1,n3,n4",
                    FAKE_ENDS="n1=usr1,n3=usr1,n4=usr1")
    batch = subprocess.Popen(["bash", str(SBATCH), "train.py"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env)
    try:
        wait_for(lambda: all((fake.log / f"{n}.ready").exists() for n in ("n1", "n3", "n4")), 30,
                 "every node left to wait for SIGUSR1")
        batch.send_signal(signal.SIGUSR1)
        out, _ = batch.communicate(timeout=60)
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.wait()
    assert batch.returncode == 0, out
    main, relay = fake.sruns()
    assert relay["options"][:3] == ["--overlap", "--nodelist=n1,n3,n4", "--nodes=3"], relay
    pids = tmp_path / "job" / "rlsup-pids" / "42"
    for name in ("n1", "n3", "n4"):
        assert (pids / f"{name}.rc").read_text() == "75\n"  # SIGUSR1 reached rlsup's own pid: it exited 75
        assert not (pids / f"{name}.pid").exists()  # gone once rlsup ended: a later relay never hits a reused pid
    assert "lost node(s): n2" in out and "preempted after saving: requeueing job 42" in out, out
    assert "requeue 42" in fake.scontrol_calls()


@pytest.mark.parametrize("late", ["75", "77"])
def test_without_spares_a_requeue_beside_a_node_that_exited_0_is_not_a_requeue(tmp_path: Path, late: str) -> None:
    """Issue 41: the script never requeues a job one of whose nodes exited 0 (rlsup exits 0 only when it saw the
    job succeed), with or without spares; srun's answer alone (the highest code) would requeue it."""
    fake, r = run_batch(tmp_path, 3, FAKE_ENDS=f"n3={late}")
    assert r.returncode == 0 and "rlsup exited 0" in r.stdout, r.stdout + r.stderr
    assert f"not requeueing it for a node that exited {late}" in r.stdout, r.stdout
    assert not any(c.startswith(("requeue", "update")) for c in fake.scontrol_calls()), fake.scontrol_calls()


# ---- min_nodes (issue 43): out of spares, the nodes left go on with at least RLSUP_MIN_NODES of the job's

def test_min_nodes_is_passed_to_every_node_and_the_step_outlives_a_lost_node(tmp_path: Path) -> None:
    # RLSUP_MIN_NODES as typed: a leading zero is still decimal
    fake = run_elastic_batch(tmp_path, 3, "3 node(s), going on with at least 2,", RLSUP_MIN_NODES="02")
    for rank, name in enumerate(nodes(3)):
        seen = fake.node(name)
        assert seen["env"]["RLSUP_MIN_NODES"] == "2" and seen["env"]["RLSUP_SPARES"] is None, seen
        assert f"--node-rank={rank}" in torchrun_args(seen["argv"]) and "--nnodes=3" in torchrun_args(seen["argv"])


def test_min_nodes_beside_spares_counts_the_job_s_nodes_only(tmp_path: Path) -> None:
    fake = run_elastic_batch(tmp_path, 5, "5 node(s) (4 for the job, the last 1 spare), going on with at least 3,",
                             RLSUP_SPARES="1", RLSUP_MIN_NODES="3")
    seen = fake.node("n5")
    assert seen["env"]["RLSUP_MIN_NODES"] == "3" and seen["env"]["RLSUP_SPARES"] == "1", seen


@pytest.mark.parametrize("floor", ["3", "0", ""])
def test_min_nodes_of_every_node_or_0_never_shrinks_and_the_step_is_as_before(tmp_path: Path, floor: str) -> None:
    """min_nodes = the job's node count (or 0, its default, or empty) lets no node go: SLURM's kill of the whole
    job on a failed node stays; 0 or empty is rlsup's default, not passed on."""
    fake, r = run_batch(tmp_path, 3, RLSUP_MIN_NODES=floor)
    assert r.returncode == 0, r.stdout + r.stderr
    (step,) = fake.sruns()
    assert step["options"] == ["--nodes=3", "--ntasks-per-node=1", "--kill-on-bad-exit=0"], step
    assert "going on with" not in r.stdout, r.stdout
    assert fake.node("n2")["env"]["RLSUP_MIN_NODES"] == (floor if floor == "3" else None)


def test_a_node_lost_leaving_too_few_nodes_requeues_the_job(tmp_path: Path) -> None:
    """Fewer than min_nodes left: the nodes wait for the lost one and ask for a requeue (75), as before."""
    fake, r = run_batch(tmp_path, 3, RLSUP_MIN_NODES="2", FAKE_LOST="n2,n3", FAKE_ENDS="n1=75")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "lost node(s): n2 n3" in r.stdout and "preempted after saving: requeueing job 42" in r.stdout, r.stdout
    assert "requeue 42" in fake.scontrol_calls()
