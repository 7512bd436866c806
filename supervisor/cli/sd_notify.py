"""Minimal sd_notify(3) for ``rlsup daemon`` under systemd ``Type=notify``: standard library only.

systemd passes ``NOTIFY_SOCKET`` (a filesystem path, or ``@name`` for the abstract namespace) and,
with ``WatchdogSec=``, ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``). Every function is a cheap no-op
returning False / None when not started by systemd, so callers never need to check.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping


def _address(environ: Mapping[str, str]) -> str | None:
    addr = environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return None
    if addr[0] == "@":  # abstract namespace: a leading NUL byte
        return "\0" + addr[1:]
    if addr[0] == "/":
        return addr
    return None  # vsock: and other forms are not supported


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``, ``"STATUS=..."``, newline-separated assignments) to systemd.

    Returns True when a datagram was sent, False when there is no NOTIFY_SOCKET or sending failed.
    """
    addr = _address(os.environ if environ is None else environ)
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            data = state.encode()
            return sock.sendall(data) is None
    except OSError:
        return False


def ready(status: str | None = None) -> bool:
    """Tell systemd the service finished starting up (``READY=1``), optionally with a status line."""
    return notify("READY=1" + (f"\nSTATUS={status}" if status else ""))


def stopping() -> bool:
    return notify("STOPPING=1")


def watchdog_ping() -> bool:
    """Keep-alive for ``WatchdogSec=`` (``WATCHDOG=1``); send at least every :func:`watchdog_interval` / 2."""
    return notify("WATCHDOG=1")


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds systemd waits for a ``WATCHDOG=1`` before it kills the service, or None if no watchdog
    applies to this process (unset, malformed, zero, or ``WATCHDOG_PID`` names another process)."""
    env = os.environ if environ is None else environ
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 1e6
