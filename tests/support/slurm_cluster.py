"""A real SLURM cluster on 127.0.0.1 for the batch-script tests: munged, slurmctld and one slurmd per node
(Debian's packages), config in a temporary directory. Several nodes are several slurmd on this host, each
under its own node name and port (``NodeAddr=127.0.0.1``), as SLURM's own multiple-slurmd test setups do.

A requeued job waits AuthInfo cred_expire (120 s by default) before it runs again; the cluster lowers it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from support.env import ROOT, clean_env
from support.ports import free_ports
from support.waits import wait_for

TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "srun")
CRED_EXPIRE = 10


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


# A test module's marks for a real SLURM cluster started here: the Debian packages, and root for slurmd.
NEEDS_SLURM = [
    pytest.mark.skipif(bool(missing_tools()), reason=f"SLURM/munge not installed (need {', '.join(missing_tools())}; "
                                                     "scripts/install_system_deps.sh)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the test cluster's slurmd must run as root to launch jobs"),
]


class Cluster:
    """``nodes`` 1: one node named after this host (as a real one-node cluster); more: nodes ``sn1``..``snN``."""

    def __init__(self, root: Path, nodes: int = 1) -> None:
        self.root = root
        self.host = socket.gethostname()
        self.node_names = [self.host] if nodes == 1 else [f"sn{i}" for i in range(1, nodes + 1)]
        self.procs: list[subprocess.Popen] = []
        self.conf = root / "slurm.conf"
        self.env = clean_env(SLURM_CONF=str(self.conf))

    def start(self) -> None:
        r = self.root
        munge = r / "munge"
        munge.mkdir(mode=0o755)  # munged refuses a socket directory others can write to
        for d in ("state", "spool", "log"):
            (r / d).mkdir()
        subprocess.run(["mungekey", "--create", f"--keyfile={munge / 'munge.key'}", "--force"], check=True,
                       capture_output=True)
        (munge / "munge.key").chmod(0o400)
        sock = munge / "munge.socket"
        self._spawn(["munged", "-F", "--force", f"--socket={sock}", f"--key-file={munge / 'munge.key'}",
                     f"--log-file={munge / 'munged.log'}", f"--pid-file={munge / 'munged.pid'}",
                     f"--seed-file={munge / 'munged.seed'}"], "munged")
        wait_for(sock.exists, 30, "munged's socket")
        ctld_port, d_port, *node_ports = free_ports(2 + len(self.node_names))
        self.conf.write_text(self._conf(sock, ctld_port, d_port, node_ports))
        (r / "plugstack.conf").write_text("")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for name in self.node_names:
            (r / "spool" / name).mkdir()
            self._spawn(["slurmd", "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}")
        wait_for(lambda: self.run("sinfo", "-h", "-N", "-o", "%t").stdout.split() == ["idle"] * len(self.node_names),
                 60, "every node to be idle")

    def _conf(self, sock: Path, ctld_port: int, d_port: int, node_ports: list[int]) -> str:
        r = self.root
        many = len(self.node_names) > 1
        per_node = "/%n" if many else ""
        cpus = f"CPUs={os.cpu_count()} State=UNKNOWN"
        if many:
            nodes = "\n".join(f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={p} {cpus}"
                              for n, p in zip(self.node_names, node_ports))
        else:
            nodes = f"NodeName={self.host} NodeAddr=127.0.0.1 {cpus}"
        node_list = ",".join(self.node_names)
        return f"""\
ClusterName=rlsuptest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire={CRED_EXPIRE}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}{per_node}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd'}{'-%n' if many else ''}.pid
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd'}{'-%n' if many else ''}.log
PlugStackConfig={r / 'plugstack.conf'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=1
JobRequeue=1
KillWait=10
MinJobAge=600
{nodes}
PartitionName=test Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab") if (self.root / "log").exists() else subprocess.DEVNULL
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))

    def run(self, *cmd: str, check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, timeout=60, check=check)

    def state(self, job: str) -> tuple[str, str]:
        out = self.run("squeue", "-h", "-j", job, "-o", "%T|%r").stdout.strip()
        if out:
            state, _, reason = out.partition("|")
            return state, reason
        m = re.search(r"JobState=(\S+)", self.run("scontrol", "show", "job", job).stdout)
        return (m.group(1) if m else "UNKNOWN"), ""

    def stop(self) -> None:
        self.run("scancel", "--full", "-u", "root")
        try:
            wait_for(lambda: self.run("squeue", "-h").stdout.strip() == "", 60, "jobs to end")
        except AssertionError:
            pass
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        out = []
        for p in sorted((self.root / "log").glob("*")):
            out.append(f"--- {p.name} ---\n{p.read_text(errors='replace')[-2500:]}")
        return "\n".join(out)



@contextmanager
def running_cluster(prefix: str, nodes: int = 1) -> Iterator[Cluster]:
    """A started cluster in its own directory under /tmp (short paths for munge's socket), its logs printed
    when the test fails, stopped and removed after."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    root.chmod(0o755)
    c = Cluster(root, nodes=nodes)
    try:
        c.start()
        yield c
    except BaseException:
        print(c.logs())
        raise
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def job_output(job_dir: Path, job: str) -> str:
    """The batch script's output file for ``job`` (the recipe's ``rlsup-train-<job>.out``), "" until it exists."""
    path = job_dir / f"rlsup-train-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def replicated(job_dir: Path, holder: str, owner: int, step: int) -> bool:
    """Node ``holder`` (a SLURM node name) holds node rank ``owner``'s part of ``step`` (one rank per node), in the
    recipe's replica directory ``$JOB_DIR/rlsup-replicas/<node>``."""
    return any((job_dir / "rlsup-replicas" / holder).glob(
        f"*.node{owner}/step_{step:09d}/manifest.rank_{owner:05d}.json"))


SBATCH = ROOT / "deploy" / "slurm" / "rlsup.sbatch"
SECRET = "s3cret-shared-by-all-nodes\n"


def submit_recipe(cluster: "Cluster", job_dir: Path, nodes: int, argv: list[str], **settings: str) -> str:
    """``sbatch --nodes=N --no-kill deploy/slurm/rlsup.sbatch ARGV`` as the script's header gives it, with a token,
    quick restarts and this host's free ports; ``settings``: the job's own (``RLSUP_SPARES``, ``RLSUP_MIN_NODES``,
    timeouts), over those. Returns the job id."""
    job_dir.mkdir(parents=True)
    token = job_dir / "token"
    token.write_text(SECRET)
    token.chmod(0o600)
    master, replication, coordinator = free_ports(3)
    env = clean_env(**{"SLURM_CONF": str(cluster.conf), "SUPERVISOR": str(Path(sys.executable).parent / "rlsup"),
                       "TORCHRUN": f"{sys.executable} -m torch.distributed.run", "JOB_DIR": str(job_dir),
                       "MASTER_PORT": str(master), "PEER_ADDR": "nodeaddr", "RLSUP_REPLICATION_PORT": str(replication),
                       "RLSUP_COORDINATOR_PORT": str(coordinator), "RLSUP_TOKEN_FILE": str(token),
                       "RLSUP_BACKOFF_INITIAL": "0.2", "RLSUP_BACKOFF_MAX": "0.5", "RLSUP_KILL_GRACE": "3",
                       "RLSUP_REPLICATION_SCAN_INTERVAL": "0.5", "RLSUP_RENDEZVOUS_TIMEOUT": "120", **settings})
    r = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", "--no-kill", f"--chdir={job_dir}", str(SBATCH),
                        *argv], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]
