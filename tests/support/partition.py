"""Network partitions for multi-node tests: each node in its own network namespace, joined to a bridge.

Why: every other multi-node test runs its nodes on one loopback, where a node can die but never be cut off.
Here node ``i`` lives in namespace ``<tag>n<i>`` with its own address (``10.<a>.<b>.<i+1>``), its own host
name (resolving in every node's ``/etc/hosts``) and one veth link to a bridge in the caller's namespace
(under pytest-xdist, the worker's own: :mod:`support.netns`). A test cuts any set of links and heals them:

- ``both``: the link is taken down on the bridge side (a pulled cable: packets vanish, no reset is sent);
- ``out`` / ``in``: one way only, an nftables drop rule in the node's namespace for what it sends to, or
  receives from, the other nodes (the link stays up; the other direction still flows).

Commands run in a node with :meth:`Partition.wrap` (``ip netns exec`` + ``unshare --uts`` to set the host
name). ``/var/run/netns`` and ``/etc/netns`` are the host's, so names carry the worker's pid and a counter,
and :meth:`Partition.close` removes every namespace, its ``/etc/netns`` directory, the bridge and whatever
still runs in the namespaces, even after a failed test. Needs root, ``ip`` and ``nft``: :func:`why_unavailable`
says what is missing so the test can skip with the reason.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Sequence

from support.waits import wait_for

Direction = Literal["both", "out", "in"]
IFNAME = "eth0"  # the node's side of its link, the same name in every namespace (GLOO_SOCKET_IFNAME)
NFT_TABLE = "partition"
_counter = itertools.count()


def why_unavailable() -> str | None:
    """Why partitions cannot be made here (not root, no ``ip``/``nft``/``unshare``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "nft", "unshare") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian: iproute2, nftables, util-linux; scripts/install_system_deps.sh)"
    return None


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")


@dataclass
class NetNode:
    """One node's namespace, link and names."""

    index: int
    netns: str
    addr: str
    hostname: str
    host_if: str  # the bridge side of the node's veth pair
    cut: set[str] = field(default_factory=set)  # the directions cut now ("both", "out", "in")


class Partition:
    """``nodes`` network namespaces on one bridge (use as a context manager: :meth:`close` always runs)."""

    def __init__(self, nodes: int, hosts_dir: Path = Path("/etc/netns")) -> None:
        tag = f"p{os.getpid()}x{next(_counter)}"  # at most 14 characters with its suffixes (IFNAMSIZ: 15)
        # A subnet of its own per worker and harness, so two harnesses in one namespace never share one.
        n = (os.getpid() * 7 + next(_counter)) % 25000
        self.prefix = f"10.{100 + n // 250}.{n % 250}"
        self.bridge = f"{tag}br"
        self.bridge_addr = f"{self.prefix}.254"
        self.hosts_dir = hosts_dir
        self.nodes = [NetNode(i, f"{tag}n{i}", f"{self.prefix}.{i + 1}", f"{tag}-node{i}", f"{tag}h{i}")
                      for i in range(nodes)]
        self._made: list[str] = []  # what close() undoes, in order made

    # ---- set-up and tear-down

    def __enter__(self) -> "Partition":
        try:
            self.setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self) -> None:
        """Make the bridge (with an address: the test process reaches every node through it), the
        namespaces, their links, addresses and hosts files."""
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        _run("ip", "addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.hostname}\n" for n in self.nodes)
        for n in self.nodes:
            _run("ip", "netns", "add", n.netns)
            self._made.append(n.netns)
            (self.hosts_dir / n.netns).mkdir(parents=True, exist_ok=True)
            (self.hosts_dir / n.netns / "hosts").write_text(hosts)
            _run("ip", "link", "add", n.host_if, "type", "veth", "peer", "name", IFNAME, "netns", n.netns)
            _run("ip", "link", "set", n.host_if, "master", self.bridge)
            _run("ip", "link", "set", n.host_if, "up")
            self.in_node(n.index, "ip", "link", "set", "lo", "up")
            self.in_node(n.index, "ip", "addr", "add", f"{n.addr}/24", "dev", IFNAME)
            self.in_node(n.index, "ip", "link", "set", IFNAME, "up")
            self.in_node(n.index, "nft", "add", "table", "inet", NFT_TABLE)
            for hook in ("input", "output"):
                self.in_node(n.index, "nft", "add", "chain", "inet", NFT_TABLE, hook,
                             f"{{ type filter hook {hook} priority 0; }}")

    def pids(self, node: int) -> list[int]:
        """The processes running in node ``node``'s namespace."""
        done = subprocess.run(["ip", "netns", "pids", self.nodes[node].netns], capture_output=True, text=True,
                              timeout=30)
        return [int(p) for p in done.stdout.split()]

    def close(self) -> None:
        """SIGKILL whatever runs in the namespaces (only this harness's nodes run there), then remove the
        namespaces, their hosts files and the bridge. Never raises: it runs after failed tests."""
        for n in self.nodes:
            if n.netns not in self._made:
                continue
            for pid in self.pids(n.index):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                wait_for(lambda n=n: not self.pids(n.index), 30, f"the processes in {n.netns} to exit")
            except Exception:
                pass
            subprocess.run(["ip", "netns", "delete", n.netns], capture_output=True, timeout=30)
            shutil.rmtree(self.hosts_dir / n.netns, ignore_errors=True)
        if "bridge" in self._made:
            subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, timeout=30)
        for n in self.nodes:  # a veth goes with its namespace; one left over (setup failed half-way) goes here
            subprocess.run(["ip", "link", "delete", n.host_if], capture_output=True, timeout=30)
        self._made.clear()

    # ---- running things in a node

    def in_node(self, node: int, *cmd: str) -> None:
        """Run a short command in node ``node``'s namespace (raises, with its stderr, if it fails)."""
        _run("ip", "netns", "exec", self.nodes[node].netns, *cmd)

    def wrap(self, node: int) -> list[str]:
        """The prefix that runs a command as node ``node``: its namespace, its /etc/hosts, its host name."""
        n = self.nodes[node]
        return ["ip", "netns", "exec", n.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                n.hostname]

    @property
    def addrs(self) -> list[str]:
        return [n.addr for n in self.nodes]

    # ---- faults

    def cut(self, nodes: Iterable[int], direction: Direction = "both") -> None:
        """Cut the links of ``nodes``: both ways (link down), or only what they send (``out``) or receive
        (``in``) from the other nodes and the bridge."""
        for i in nodes:
            n = self.nodes[i]
            if direction == "both":
                _run("ip", "link", "set", n.host_if, "down")
            else:
                hook, match = ("output", "daddr") if direction == "out" else ("input", "saddr")
                self.in_node(i, "nft", "add", "rule", "inet", NFT_TABLE, hook, "ip", match,
                             f"{self.prefix}.0/24", "drop")
            n.cut.add(direction)

    def heal(self, nodes: Sequence[int] | None = None) -> None:
        """Undo every cut of ``nodes`` (default all)."""
        for i in (range(len(self.nodes)) if nodes is None else nodes):
            n = self.nodes[i]
            if "both" in n.cut:
                _run("ip", "link", "set", n.host_if, "up")
            for hook in ("input", "output"):
                self.in_node(i, "nft", "flush", "chain", "inet", NFT_TABLE, hook)
            n.cut.clear()
