"""A test worker's own loopback: each pytest-xdist worker moves into a fresh network namespace.

Why: tests run rlsup with its defaults as users type them (the coordinator's fixed port 9780, torchrun's
29500, two jobs on the same "hosts"), so two workers sharing one 127.0.0.1 would collide on those ports. In
its own namespace a worker is a machine of its own: the same addresses and ports, nothing shared. Stdlib only
(ctypes and an ioctl), so the fast tier pays nothing for it.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
SIOCSIFADDR = 0x8916
IFF_UP = 0x1
IFREQ = "16sH22x"  # struct ifreq: the interface name, then ifr_flags, padded to its 40 bytes
IFREQ_ADDR = "16sH2s4s16x"  # struct ifreq: the name, then a sockaddr_in (family, port, address), padded
# glibc's getaddrinfo(AI_ADDRCONFIG) counts an IPv4 address as configured only when it is not 127.0.0.1, and a
# fresh namespace has no other: slurmctld then cannot resolve its own listening address. A second loopback
# address (still 127.0.0.0/8, still this namespace's own) makes the namespace look like a machine.
SECOND_LOOPBACK = "127.0.0.2"


def enter_own_network_namespace() -> str | None:
    """Move this thread (and every process and thread it starts from now on) into a new network namespace
    with its loopback up. Returns None on success, else why not (not root, no namespaces in this kernel or
    container): the caller then shares the host's loopback and says so."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        return f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack(IFREQ, b"lo", 0)
        flags = struct.unpack(IFREQ, fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))
        fcntl.ioctl(s, SIOCSIFADDR, struct.pack(IFREQ_ADDR, b"lo:1", socket.AF_INET, b"\0\0",
                                                socket.inet_aton(SECOND_LOOPBACK)))
    with socket.socket() as probe:  # the new loopback answers, or this namespace is no use
        probe.bind(("127.0.0.1", 0))
    return None
