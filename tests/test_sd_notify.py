"""supervisor.cli.sd_notify against real AF_UNIX datagram sockets (path and abstract namespace)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from support.env import ROOT
from supervisor.cli import sd_notify


@pytest.fixture
def path_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def test_ready_watchdog_status_on_path_socket(path_socket: socket.socket) -> None:
    assert sd_notify.ready() is True
    assert path_socket.recv(4096) == b"READY=1"
    assert sd_notify.watchdog_ping() is True
    assert path_socket.recv(4096) == b"WATCHDOG=1"
    assert sd_notify.notify("STATUS=replicating\nMAINPID=42") is True
    assert path_socket.recv(4096) == b"STATUS=replicating\nMAINPID=42"
    assert sd_notify.ready("serving") is True
    assert path_socket.recv(4096) == b"READY=1\nSTATUS=serving"


def test_abstract_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"rlsup-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sd_notify.notify("STOPPING=1") is True
        assert sock.recv(4096) == b"STOPPING=1"


def test_from_a_child_process(path_socket: socket.socket) -> None:
    """The way systemd sees it: another process, environment inherited."""
    code = "from supervisor.cli import sd_notify; import sys; sys.exit(0 if sd_notify.ready() else 1)"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
    assert path_socket.recv(4096) == b"READY=1"


def test_no_socket_is_a_quiet_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sd_notify.ready() is False
    assert sd_notify.watchdog_ping() is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    assert sd_notify.notify("READY=1") is False  # ENOENT / ECONNREFUSED is reported, not raised
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")
    assert sd_notify.notify("READY=1") is False


def test_watchdog_interval() -> None:
    me = str(os.getpid())
    assert sd_notify.watchdog_interval({}) is None
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "1500000", "WATCHDOG_PID": me}) == 1.5
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "1500000", "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "soon"}) is None
    assert sd_notify.watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "x"}) is None


def test_watchdog_interval_reads_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sd_notify.watchdog_interval() == 2.0


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
