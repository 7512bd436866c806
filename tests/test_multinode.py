"""Three node supervisors on 127.0.0.1 (own ports, own directories) around a 3-node torchrun job,
launched as PyTorch documents multi-node jobs: ``--rdzv-backend c10d --rdzv-endpoint``.

Shows: every checkpoint part reaches its replica holder with matching checksums; a node SIGKILLed and
wiped is replaced by one with an empty disk, and all nodes resume from the newest step whose parts
survive, ending bit-identical to an uninterrupted run; a corrupted replica is never used. c10d orders
nodes by join order (and ignores --node-rank); rlsup pins each node's ranks, so every rank resumes from
its own part, and what rlsup says it resumed ("from step N") is what every trainer loaded. Losing node 0
(which hosts the embedded coordination store and torchrun's master) is survived the same way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch

from conftest import ROOT, clean_env, free_ports, incidents, replica_ns, rlsup_cmd, run_rlsup, wait_for
from rlsup_format.manifest import hash_file, list_step_dirs, manifest_name, read_manifest

TRAIN = str(ROOT / "examples" / "train_tiny.py")
PY = sys.executable
NODES = 3
STEPS = 24
TRAIN_ARGS = ["--steps", str(STEPS), "--checkpoint-every", "3", "--step-time", "0.15", "--keep-last", "100"]


class Cluster:
    """Node supervisors as separate `rlsup run` processes, each in its own directory (its own "machine")."""

    def __init__(self, root: Path, nodes: int = NODES, rdzv: str = "c10d", extra: list[str] | None = None,
                 train_args: list[str] | None = None, log_name: str = "rlsup.log") -> None:
        self.root, self.nodes, self.rdzv, self.log_name = root, nodes, rdzv, log_name
        self.extra = extra or []
        self.train_args = train_args or TRAIN_ARGS
        self.repl_ports: list[int]
        self.coord_port: int | None  # None: the default port, as a user who sets none gets
        *self.repl_ports, self.coord_port, self.master_port = free_ports(nodes + 2)
        self.token = root / "token"
        self.token.write_text("s3cret-shared-by-all-nodes\n")
        self.token.chmod(0o600)
        self.procs: dict[int, subprocess.Popen] = {}

    def node_dir(self, node: int) -> Path:
        return self.root / f"node{node}"

    def launcher(self, node: int) -> list[str]:
        """torchrun as a user types it: c10d (no node rank: torchrun ignores it) or static."""
        common = [PY, "-m", "torch.distributed.run", "--nnodes", str(self.nodes), "--nproc-per-node", "1"]
        if self.rdzv == "c10d":
            return [*common, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.master_port}",
                    "--rdzv-id", "job1"]
        return [*common, "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(self.master_port)]

    def start(self, node: int) -> None:
        d = self.node_dir(node)
        d.mkdir(parents=True, exist_ok=True)
        peers = ",".join(f"127.0.0.1:{p}" for p in self.repl_ports)
        coord = ["--coordinator-port", str(self.coord_port)] if self.coord_port else []
        args = ["run", "--peers", peers, "--node-rank", str(node), *coord, "--token-file", str(self.token), "--replication-scan-interval", "0.5", "--heartbeat-timeout", "60",
                "--backoff-initial", "0.2", "--backoff-max", "0.5", "--rendezvous-timeout", "120",
                "--kill-grace", "3", *self.extra, "--",
                *self.launcher(node), TRAIN, *self.train_args, "--out", str(d / self.out_name)]
        log = open(d / self.log_name, "ab")
        self.procs[node] = subprocess.Popen(rlsup_cmd(*args), cwd=d, env=clean_env(), stdout=log,
                                            stderr=subprocess.STDOUT)

    def lose(self, node: int) -> None:
        """SIGKILL the node's supervisor (its job dies with it) and take its disk away."""
        self.procs[node].send_signal(signal.SIGKILL)
        self.procs[node].wait(timeout=30)
        os.rename(self.node_dir(node), self.root / f"node{node}.lost")

    def wait_all(self, timeout: float) -> dict[int, int]:
        codes = {}
        for node, proc in self.procs.items():
            try:
                codes[node] = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                codes[node] = -999
        return codes

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    @property
    def out_name(self) -> str:
        return self.log_name.replace(".log", "-final.pt")

    def log(self, node: int) -> str:
        path = self.node_dir(node) / self.log_name
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- node {n} ---\n" + self.log(n)[-3000:] for n in range(self.nodes))


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


def replica_part(cluster: Cluster, holder: int, owner: int, step: int) -> Path:
    return replica_ns(cluster.node_dir(holder) / "replicas", owner) / f"step_{step:09d}"


def reference_weights(tmp: Path, nodes: int = NODES, train_args: list[str] = TRAIN_ARGS) -> dict[str, torch.Tensor]:
    out = tmp / "reference.pt"
    subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nodes), TRAIN,
                    *train_args, "--step-time", "0", "--checkpoint-dir", str(tmp / "ref_ckpt"), "--out", str(out)],
                   env=clean_env(), check=True, capture_output=True, timeout=300)
    return torch.load(out, weights_only=True)


def assert_same_weights(path: Path, ref: dict[str, torch.Tensor]) -> None:
    final = torch.load(path, weights_only=True)
    for name in ref:
        assert torch.equal(final[name], ref[name]), f"{name} differs from the uninterrupted run"


def test_replicas_match_then_node_loss_resumes_bit_identical(tmp_path: Path) -> None:
    ref = reference_weights(tmp_path)
    cluster = Cluster(tmp_path)
    try:
        for node in range(NODES):
            cluster.start(node)
        # Node 2's parts are replicated to node 0 (ring, factor 1). Wait for step 12's copy, then lose node 2.
        wait_for(lambda: (replica_part(cluster, 0, 2, 12) / manifest_name(2)).exists(), 180,
                 "node 2's step 12 part replicated to node 0")
        cluster.lose(2)  # the node and its disk are gone
        # Corrupt node 0's replica of the newest node-2 step it holds: it must never be used.
        held = [s for s, d in list_step_dirs(replica_ns(cluster.node_dir(0) / "replicas", 2))
                if (d / manifest_name(2)).exists()]
        corrupt_step = max(held)
        victim = replica_part(cluster, 0, 2, corrupt_step) / "rank_00002.pt"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        cluster.start(2)  # the replacement, with an empty directory
        codes = cluster.wait_all(timeout=300)
        assert codes == {0: 0, 1: 0, 2: 0}, cluster.logs()
    finally:
        cluster.kill_all()

    # Every node ended bit-identical to the uninterrupted run (rank 0 writes the weights on node 0).
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)
    # c10d was pinned to rlsup's node ranks, and what rlsup said each launch resumed from is what the
    # trainer loaded (every rank must: a rank missing its part fails the attempt, it never starts fresh).
    log0 = cluster.log(0)
    assert "launcher rendezvous pinned to rlsup's node rank" in log0, log0[-3000:]
    assert trainer_starts(log0) == [r or 0 for r in rlsup_resumes(log0)] and trainer_starts(log0)[-1] > 0, log0[-4000:]
    # The replacement resumed from a step it fetched from a peer, never the corrupted one.
    inc2 = incidents(cluster.node_dir(2) / ".rlsup")
    inc0 = incidents(cluster.node_dir(0) / ".rlsup")
    resumed = [i["resumed_step"] for i in inc0 if i.get("resumed_step") is not None]
    # The newest step whose parts all survive uncorrupted: one checkpoint before the corrupted replica.
    assert resumed and resumed[-1] == corrupt_step - 3, (corrupt_step, inc0)
    assert all(i["reason"] != "success" for i in inc2)
    # Every checkpoint part reached its replica holder with matching checksums.
    for owner in range(NODES):
        holder = (owner + 1) % NODES
        for step, step_dir in list_step_dirs(cluster.node_dir(owner) / "checkpoints"):
            mpath = step_dir / manifest_name(owner)
            if not mpath.exists():
                continue
            replica = replica_part(cluster, holder, owner, step)
            wait_for(lambda: (replica / manifest_name(owner)).exists(), 30, f"replica of node {owner} step {step}")
            manifest = read_manifest(mpath)
            for name, entry in manifest.files.items():
                assert hash_file(replica / name) == entry, f"replica {replica / name} differs"
    # `rlsup status` shows where each step's parts live and the progress per peer.
    status = json.loads(run_rlsup(["status", "--json"], cluster.node_dir(0)).stdout)
    rep = status["replication"]
    assert rep["targets"] == [1] and rep["progress"]["1"]["bytes_sent"] > 0
    assert rep["placement"]["9"]["0"] == [f"127.0.0.1:{cluster.repl_ports[1]}"]
    text = run_rlsup(["status"], cluster.node_dir(0)).stdout
    assert "replication: node 0 -> nodes [1]" in text and "step 9: node 0 parts on" in text


def lose_node_0_and_replace(cluster: Cluster, before_loss=lambda: None) -> int:
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


def assert_resumed_at_least(cluster: Cluster, complete: int, ref: dict[str, torch.Tensor]) -> None:
    """Bit-identical, and the replacement node 0 resumed (as rlsup said and the trainer loaded) from a
    step at least as new as ``complete``."""
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, ref)
    log0 = cluster.log(0)
    starts = trainer_starts(log0)
    assert starts and starts[0] >= complete, (complete, log0[-4000:])
    assert starts == [r or 0 for r in rlsup_resumes(log0)], log0[-4000:]


def test_node_0_lost_and_replaced_with_an_empty_disk_resumes_bit_identical(tmp_path: Path) -> None:
    """Node 0 hosts the embedded coordination store and torchrun's master. It is SIGKILLed and its disk
    wiped; the other nodes wait for a replacement, which joins with an empty disk, re-hosts the store,
    fetches node 0's parts from their replicas, and the job resumes from a step at least as new as the
    newest one that was complete and replicated when node 0 died, ending bit-identical."""
    ref = reference_weights(tmp_path)
    cluster = Cluster(tmp_path)
    complete = lose_node_0_and_replace(cluster)
    assert_resumed_at_least(cluster, complete, ref)
    assert "is gone; waiting" in cluster.log(1), cluster.log(1)[-3000:]  # node 1 waited for the new store
