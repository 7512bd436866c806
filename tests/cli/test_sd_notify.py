"""supervisor.cli.sd_notify against real AF_UNIX datagram sockets (path and abstract namespace)."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

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


