"""The end-to-end half of test_sd_notify.py (real processes, or waits on real time): supervisor.cli.sd_notify
against real AF_UNIX datagram sockets (path and abstract namespace)."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path
import os
import sys
from support.env import ROOT
import test_sd_notify as fast_tier
path_socket = fast_tier.path_socket




def test_rlsup_daemon_speaks_the_protocol(tmp_path: Path) -> None:
    """`rlsup daemon` as systemd's Type=notify + WatchdogSec= sees it: READY=1 once it serves,
    WATCHDOG=1 at half the interval, STOPPING=1 on SIGTERM, then exit 0."""
    from support.env import clean_env
    from support.ports import free_ports
    from support.procs import rlsup_cmd

    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(60)
    p0, p1 = free_ports(2)
    token = tmp_path / "token"
    token.write_text("sd-notify-test-secret\n")
    token.chmod(0o600)
    args = ["daemon", "--peers", f"127.0.0.1:{p0},127.0.0.1:{p1}", "--node-rank", "0", "--token-file", str(token),
            "--state-dir", str(tmp_path / "state"), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--replica-dir", str(tmp_path / "replicas"), "--replication-factor", "0"]  # no pushes to drain at stop
    env = clean_env(NOTIFY_SOCKET=str(sock_path), WATCHDOG_USEC="600000")  # 0.6 s: a ping every 0.3 s
    proc = subprocess.Popen(rlsup_cmd(*args), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert sock.recv(4096) == b"READY=1"
        with socket.create_connection(("127.0.0.1", p0), timeout=5):  # serving when it said READY
            pass
        assert [sock.recv(4096) for _ in range(3)] == [b"WATCHDOG=1"] * 3
        proc.send_signal(signal.SIGTERM)
        while (msg := sock.recv(4096)) == b"WATCHDOG=1":
            pass
        assert msg == b"STOPPING=1"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=30)[0]
        sock.close()
    assert "replication endpoint" in out, out


def test_from_a_child_process(path_socket: socket.socket) -> None:
    """The way systemd sees it: another process, environment inherited."""
    code = "from supervisor.cli import sd_notify; import sys; sys.exit(0 if sd_notify.ready() else 1)"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
    assert path_socket.recv(4096) == b"READY=1"

