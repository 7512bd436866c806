"""The multi-node harness: N node supervisors as separate ``rlsup run`` processes on 127.0.0.1, each in its own
working directory standing for its own machine, around one torchrun job of ``examples/train_tiny.py``.

The flags every node gets are in one place, :meth:`Cluster.node_args`; a test adds its own through ``extra``
(per cluster) or :meth:`Cluster.start`'s ``extra`` (per start). Also here: what the nodes' logs say about
resumes, where replicas land, and the uninterrupted run the results are compared with.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Literal, Sequence

from rlsup_format.manifest import list_step_dirs, manifest_name
from support.env import PY, ROOT, TRAIN, clean_env
from support import forked_ranks
from support.forked_ranks import ForkedPhase, run_phases
from support.incidents import read_state
from support.ports import free_ports
from support.procs import kill_and_reap, processes_naming, rlsup_cmd
from support.waits import wait_for

NODES = 3
STEPS = 24
TRAIN_ARGS = ["--steps", str(STEPS), "--checkpoint-every", "3", "--step-time", "0.15", "--keep-last", "100"]
REFERENCE_CACHE = Path(tempfile.gettempdir()) / f"rlsup-test-references-{os.getuid()}"
SECRET = "s3cret-shared-by-all-nodes\n"
# Attempt 0 holds after step 12 (rank 0 stops; the others wait in its next collective) until node 0 is lost: a
# test that loses node 0 once its step 9 is replicated cannot find the job already finished on a loaded machine
# (it did: the other nodes succeeded and the replacement waited for them in vain). The weights are TRAIN_ARGS'.
HELD_FOR_NODE_0_LOSS = [*TRAIN_ARGS, "--hang-at-step", "12", "--fault-rank", "0"]
# rlsup's flags beside it: the held rank is silent until the loss, which must not be called a hang first
HELD_PATIENCE = ["--heartbeat-timeout", "600"]
Rendezvous = Literal["c10d", "static"]


class Cluster:
    """Node supervisors as separate `rlsup run` processes, each in its own directory (its own "machine").

    ``rdzv``: how torchrun meets, ``c10d`` (as PyTorch documents multi-node jobs; torchrun ignores a node rank,
    rlsup pins it) or ``static`` (``--node-rank`` and a master address). ``log_name`` names each node's rlsup
    output and, by default, the final weights (``rlsup.log`` -> ``rlsup-final.pt``): two jobs in the same node
    directories keep theirs apart. ``env``: the environment of every node (default :func:`clean_env`).
    ``hosts``: each node's address (default 127.0.0.1 for all), ``wrap``: a node's command prefix (default none),
    for nodes in network namespaces of their own (:mod:`support.partition`).

    ``warm_launcher`` (default on, as in rlsup): each node's attempts start from a launcher whose ranks are forked
    from its one torch import. Measured over tests/cluster on four workers: 409 s of CPU and 253 s against 415 s
    and 276 s with it off (the unused launcher each node run arms last costs about what the forks save)."""

    def __init__(self, root: Path, nodes: int = NODES, rdzv: Rendezvous = "c10d", extra: Sequence[str] = (),
                 train_args: Sequence[str] | None = None, log_name: str = "rlsup.log", *,
                 scan_interval: float = 0.5, rendezvous_timeout: float = 120, env: dict[str, str] | None = None,
                 secret: str = SECRET, hosts: Sequence[str] | None = None,
                 wrap: Callable[[int], list[str]] | None = None, warm_launcher: bool = True) -> None:
        self.warm_launcher = warm_launcher
        self.hosts = list(hosts or ["127.0.0.1"] * nodes)
        self.wrap = wrap or (lambda node: [])
        self.root, self.nodes, self.rdzv, self.log_name = root, nodes, rdzv, log_name
        self.extra = list(extra)
        self.train_args = list(train_args or TRAIN_ARGS)
        self.scan_interval, self.rendezvous_timeout = scan_interval, rendezvous_timeout
        self.env = env
        self.out_name = log_name.replace(".log", "-final.pt")
        self.repl_ports: list[int]
        self.coord_port: int | None  # None: the default port, as a user who sets none gets
        self.master_port: int
        self.new_ports()
        self.token = root / "token"
        self.token.write_text(secret)
        self.token.chmod(0o600)
        self.procs: dict[int, subprocess.Popen] = {}

    def new_ports(self) -> None:
        """Fresh ports (for a restart of every node: the killed store and rendezvous may linger in TIME_WAIT)."""
        *self.repl_ports, self.coord_port, self.master_port = free_ports(self.nodes + 2)

    @property
    def peers(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in zip(self.hosts, self.repl_ports))

    def node_dir(self, node: int) -> Path:
        return self.root / f"node{node}"

    def launcher(self, node: int) -> list[str]:
        """torchrun as a user types it: c10d (no node rank: torchrun ignores it) or static."""
        common = [PY, "-m", "torch.distributed.run", "--nnodes", str(self.nodes), "--nproc-per-node", "1"]
        if self.rdzv == "c10d":
            return [*common, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts[0]}:{self.master_port}",
                    "--rdzv-id", "job1"]
        return [*common, "--node-rank", str(node), "--master-addr", self.hosts[0], "--master-port",
                str(self.master_port)]

    def node_args(self, node: int, extra: Sequence[str] = ()) -> list[str]:
        """``rlsup run ...`` of node ``node``: the flags every node of every cluster test gets (quick restarts,
        a generous heartbeat and rendezvous for a loaded machine), then the cluster's and this start's own."""
        coord = ["--coordinator-port", str(self.coord_port)] if self.coord_port else []
        return ["run", "--peers", self.peers, "--node-rank", str(node), *coord, "--token-file", str(self.token),
                "--replication-scan-interval", str(self.scan_interval), "--heartbeat-timeout", "60",
                "--backoff-initial", "0.2", "--backoff-max", "0.5", "--rendezvous-timeout", str(self.rendezvous_timeout),
                "--kill-grace", "3", *([] if self.warm_launcher else ["--warm-launcher", "false"]),
                *self.extra, *extra, "--",
                *self.launcher(node), TRAIN, *self.train_args, "--out", str(self.node_dir(node) / self.out_name)]

    def start(self, node: int, extra: Sequence[str] = (), log_name: str | None = None) -> subprocess.Popen:
        """Start node ``node``'s supervisor in its directory (made if missing), its output appended to
        ``log_name`` (default the cluster's) there."""
        d = self.node_dir(node)
        d.mkdir(parents=True, exist_ok=True)
        with open(d / (log_name or self.log_name), "ab") as log:
            self.procs[node] = subprocess.Popen([*self.wrap(node), *rlsup_cmd(*self.node_args(node, extra))], cwd=d,
                                                env=self.env if self.env is not None else clean_env(), stdout=log,
                                                stderr=subprocess.STDOUT)
        return self.procs[node]

    def start_all(self) -> None:
        for node in range(self.nodes):
            self.start(node)

    def lose(self, node: int) -> None:
        """SIGKILL the node's supervisor (its job dies with it) and take its disk away."""
        self.procs[node].send_signal(signal.SIGKILL)
        self.procs[node].wait(timeout=30)
        os.rename(self.node_dir(node), self.root / f"node{node}.lost")

    def wait_all(self, timeout: float) -> dict[int, int]:
        """Every started node's exit code, -999 for one still running ``timeout`` seconds from now."""
        deadline = time.monotonic() + timeout
        codes = {}
        for node, proc in self.procs.items():
            try:
                codes[node] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[node] = -999
        return codes

    def kill_all(self) -> None:
        """SIGKILL every node supervisor, then wait until nothing of their jobs is left running (a process naming
        a node's directory: every rank gets its ``--out`` there; what else the test runs under ``root``, an etcd
        cluster say, is not the nodes')."""
        for proc in self.procs.values():
            kill_and_reap(proc, timeout=None)
        nodes = [str(self.node_dir(n)) + os.sep for n in range(self.nodes)]
        wait_for(lambda: not processes_naming(*nodes), 30, "the killed nodes' ranks to exit")

    def log(self, node: int) -> str:
        path = self.node_dir(node) / self.log_name
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self, tail: int | None = 3000) -> str:
        """Each node's rlsup output: its last ``tail`` characters (for assertion messages), or all of it."""
        return "\n".join(f"--- node {n} ---\n" + self.log(n)[-(tail or 0):] for n in range(self.nodes))

    def supervisor_libraries(self, node: int) -> set[str]:
        """The shared objects mapped by ``node``'s rlsup process itself (not its job's, not the warm launcher's)."""
        import psutil

        root = psutil.Process(self.procs[node].pid)
        libs: set[str] = set()
        for p in [root, *root.children(recursive=True)]:
            try:
                if "supervisor.cli.main" not in p.cmdline():
                    continue
                libs |= {os.path.basename(m.path) for m in p.memory_maps() if m.path.endswith(".so") or ".so." in m.path}
            except psutil.Error:
                continue
        return libs

    def state(self, node: int) -> dict:
        """Node ``node``'s ``state.json``."""
        return read_state(self.node_dir(node) / ".rlsup")


def trainer_starts(log: str) -> list[int]:
    """The steps rank 0's trainer said it started from, attempt by attempt."""
    return [int(m) for m in re.findall(r"\[train_tiny\] attempt \d+: starting at step (\d+)", log)]


def rlsup_resumes(log: str) -> list[int | None]:
    """What rlsup said each launch resumed from (None: a fresh start)."""
    out: list[int | None] = []
    for line in log.splitlines():
        if "[rlsup] attempt" in line and ": launching" in line:
            m = re.search(r" from step (\d+) ", line)
            out.append(int(m.group(1)) if m else None)
    return out


def replica_ns(replica_root: Path, owner: int) -> Path:
    """The replica namespace holding ``owner``'s parts (``<job>.node<owner>``); one job per test dir."""
    found = sorted(replica_root.glob(f"*.node{owner}"))
    assert len(found) <= 1, f"more than one job's replicas of node {owner}: {found}"
    return found[0] if found else replica_root / f"missing.node{owner}"


def replica_part(cluster: Cluster, holder: int, owner: int, step: int) -> Path:
    """Where node ``holder`` keeps its replica of node ``owner``'s part of ``step``."""
    return replica_ns(cluster.node_dir(holder) / "replicas", owner) / f"step_{step:09d}"


def job_subdir(persistent_root: Path) -> Path:
    """The job's directory in a persistent tier (``<persistent_dir>/<job>/``); one job per test dir."""
    found = [p for p in persistent_root.iterdir() if p.is_dir()] if persistent_root.is_dir() else []
    assert len(found) <= 1, f"more than one job in {persistent_root}: {found}"
    return found[0] if found else persistent_root / "missing-job"


def reference_weights(tmp: Path, nodes: int = NODES, train_args: Sequence[str] = TRAIN_ARGS) -> dict:
    """The final weights of the same training run uninterrupted and unsupervised (``nodes`` ranks, one host).

    Run once per (nodes, arguments, trainer and hook sources, torch): several modules and workers compare with
    the same run, and it is deterministic (that is what every bit-identical test relies on). The weights are
    cached under the system temp directory, with a lock so two xdist workers never run it twice at once. Its ranks
    are forked as torchrun's (:mod:`support.forked_ranks`): one ``import torch`` for the run, not four."""
    import torch

    key = _reference_key(nodes, train_args)
    cache = REFERENCE_CACHE / key
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / "reference.pt"
    with open(cache / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_file():
            part = cache / "reference.pt.part"
            # A directory of this run's own: a checkpoint directory another reference left (a test may ask for
            # two from one ``tmp``) would be resumed from, and its weights cached under this key.
            work = tmp / f"reference-{key}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            run_phases(TRAIN, [ForkedPhase(nodes, (*train_args, "--step-time", "0", "--checkpoint-dir",
                                                   str(work / "ckpt"), "--out", str(part)),
                                           str(work / "rank"))], work, clean_env())
            os.replace(part, out)
    return torch.load(out, weights_only=True)


def _reference_key(nodes: int, train_args: Sequence[str]) -> str:
    """What the reference run's weights depend on: the arguments, the sources the trainer runs, torch, and how its
    ranks are started (a change there is a new reference, never weights cached by the old way)."""
    import torch

    digest = hashlib.sha256(repr((nodes, list(train_args), torch.__version__)).encode())
    for source in sorted([Path(TRAIN), Path(forked_ranks.__file__), *ROOT.joinpath("trainer_hooks").rglob("*.py"),
                          *ROOT.joinpath("rlsup_format").rglob("*.py")]):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:24]


def assert_same_weights(path: Path, ref: dict) -> None:
    """The weights at ``path`` equal ``ref`` bit for bit."""
    import torch

    final = torch.load(path, weights_only=True)
    for name in ref:
        assert torch.equal(final[name], ref[name]), f"{name} differs from the uninterrupted run"


def lose_node_0_and_replace(cluster: Cluster, before_loss: Callable[[], object] = lambda: None) -> int:
    """Run the job, lose node 0 once its step 9 part is replicated (``before_loss`` runs just before),
    start a replacement with an empty disk, and wait for the end. Returns the newest step that was
    complete and replicated when node 0 died (every resume must be at least as new)."""
    try:
        for node in range(cluster.nodes):
            cluster.start(node)
        wait_for(lambda: (replica_part(cluster, 1, 0, 9) / manifest_name(0)).exists(), 180,
                 "node 0's step 9 part replicated to node 1")
        before_loss()
        cluster.lose(0)
        held0 = {s for s, d in list_step_dirs(replica_ns(cluster.node_dir(1) / "replicas", 0))
                 if (d / manifest_name(0)).exists()}
        own = [{s for s, d in list_step_dirs(cluster.node_dir(n) / "checkpoints") if (d / manifest_name(n)).exists()}
               for n in range(1, cluster.nodes)]
        complete = max(held0.intersection(*own))
        cluster.start(0)  # the replacement: same address, empty directory
        codes = cluster.wait_all(timeout=300)
        assert codes == {n: 0 for n in range(cluster.nodes)}, cluster.logs()
    finally:
        cluster.kill_all()
    return complete


def assert_resumed_at_least(cluster: Cluster, complete: int, ref: dict) -> None:
    """Bit-identical, and the replacement node 0 resumed (as rlsup said and the trainer loaded) from a
    step at least as new as ``complete``."""
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)
    log0 = cluster.log(0)
    starts = trainer_starts(log0)
    assert starts and starts[0] >= complete, (complete, log0[-4000:])
    assert starts == [r or 0 for r in rlsup_resumes(log0)], log0[-4000:]
