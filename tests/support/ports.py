"""Free TCP ports on 127.0.0.1 (stdlib only: importing this costs nothing)."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (all bound at once, so no duplicates)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def free_port() -> int:
    """One TCP port free on 127.0.0.1 right now."""
    return free_ports(1)[0]
