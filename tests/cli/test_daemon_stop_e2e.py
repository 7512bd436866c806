"""``rlsup daemon`` stops on SIGTERM even when signals keep landing inside its wait.

Its handler was ``lambda *_: stop.set()`` while the main thread waited on the same Event in slices: a
SIGTERM whose handler ran inside ``Event.wait``'s locked lines (or inside an earlier handler's ``set``)
waited for that lock forever, the daemon never stopped, and systemd or SLURM killed it after their
timeout. The daemon here runs under a tracer that re-sends SIGTERM at every line of threading's wait and
set (capped), once the test arms it, so that moment is met every time (tests/processes/test_stop_signals_e2e.py does the
same for the run loop and the ranks).
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.env import clean_env
from support.ports import free_ports

WRAPPER = textwrap.dedent("""
    import os, runpy, signal, sys, threading
    armed = sys.argv.pop(1)
    LOCKED = {threading.Event.wait.__code__, threading.Event.set.__code__, threading.Condition.wait.__code__,
              threading.Condition.notify_all.__code__, threading.Condition.notify.__code__,
              threading.Condition.__enter__.__code__}
    sent = 0

    def tracer(frame, event, arg):
        global sent
        if frame.f_code not in LOCKED:
            return None
        if sent < 300 and os.path.exists(armed):
            sent += 1
            os.kill(os.getpid(), signal.SIGTERM)
        return tracer

    sys.settrace(tracer)
    sys.argv = ["rlsup", *sys.argv[1:]]
    runpy.run_module("supervisor.cli.main", run_name="__main__")
""")


@pytest.mark.timeout(180)
def test_daemon_stops_with_sigterm_landing_inside_its_wait(tmp_path: Path) -> None:
    p0, p1 = free_ports(2)
    token = tmp_path / "token"
    token.write_text("daemon-stop-test-secret\n")
    token.chmod(0o600)
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(60)
    armed = tmp_path / "armed"
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    args = ["daemon", "--peers", f"127.0.0.1:{p0},127.0.0.1:{p1}", "--node-rank", "0", "--token-file", str(token),
            "--state-dir", str(tmp_path / "state"), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--replica-dir", str(tmp_path / "replicas"), "--replication-factor", "0"]
    proc = subprocess.Popen([sys.executable, str(wrapper), str(armed), *args], cwd=tmp_path,
                            env=clean_env(NOTIFY_SOCKET=str(sock_path)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert sock.recv(4096) == b"READY=1"  # serving, its handlers installed, in its wait loop
        armed.touch()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("rlsup daemon deadlocked: a SIGTERM landing inside its wait was never acted on")
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=30)[0]
        sock.close()
    assert code == 0, out
