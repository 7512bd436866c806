"""`rlsup daemon` per node: a checkpoint replicates when its manifest appears; a dead peer delays nothing else."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import torch

from support.env import clean_env
from support.ports import free_ports
from support.procs import rlsup_cmd
from support.waits import wait_for
from supervisor.job_identity import job_identity, namespace_of
from trainer_hooks import CheckpointManager
from rlsup_format.manifest import hash_file, manifest_name, read_manifest


def start_daemon(d: Path, peers: str, node: int, token: Path, factor: int) -> subprocess.Popen:
    d.mkdir(parents=True, exist_ok=True)
    args = ["daemon", "--peers", peers, "--node-rank", str(node), "--token-file", str(token),
            "--replication-factor", str(factor), "--replication-scan-interval", "30"]
    return subprocess.Popen(rlsup_cmd(*args), cwd=d, env=clean_env(), stdout=open(d / "daemon.log", "ab"),
                            stderr=subprocess.STDOUT)


def test_daemon_replicates_on_manifest_and_dead_peer_slows_nothing(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-shared-secret-of-some-length\n")
    token.chmod(0o600)
    p0, dead, p2 = free_ports(3)  # nothing listens on `dead`: node 1, node 0's first copy target, is down
    peers = f"127.0.0.1:{p0},127.0.0.1:{dead},127.0.0.1:{p2}"
    n0, n1 = tmp_path / "node0", tmp_path / "node2"
    daemons = [start_daemon(n0, peers, 0, token, factor=2), start_daemon(n1, peers, 2, token, factor=2)]
    try:
        wait_for(lambda: (n0 / ".rlsup" / "daemon.json").exists() and (n1 / ".rlsup" / "daemon.json").exists(),
                 60, "both daemons up")
        model = torch.nn.Linear(64, 64)
        started = time.monotonic()
        step_dir = CheckpointManager(n0 / "checkpoints").save(7, {"model": model})
        replica = n1 / "replicas" / namespace_of(job_identity("", "checkpoints", True, environ={}, peers=peers.split(",")).id, 0) / step_dir.name
        # The scan interval is 30 s: only the watchdog event can make this arrive in time.
        wait_for(lambda: (replica / manifest_name(0)).exists(), 20, "step 7 replicated to node 2")
        elapsed = time.monotonic() - started
        manifest = read_manifest(step_dir / manifest_name(0))
        for name, entry in manifest.files.items():
            assert hash_file(replica / name) == entry
        placement = wait_for(lambda: list(step_dir.glob(".rlsup-placement.node0.json")), 10, "placement record")
        assert str(p2) in placement[0].read_text()
        assert elapsed < 20
    finally:
        for d in daemons:
            d.send_signal(signal.SIGTERM)
        codes = [d.wait(timeout=60) for d in daemons]
    assert codes == [0, 0]
    assert not (n0 / ".rlsup" / "daemon.json").exists()
    log = (n0 / "daemon.log").read_text()
    assert "replication to node 1 failed" in log  # the dead peer is reported, not silently skipped
