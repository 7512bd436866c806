"""Who the nodes are: peers in node-rank order, this node's rank, and where its replicas go.

Sources: explicit ``peers``/``node_rank`` (YAML or flags), else SLURM (``SLURM_JOB_NODELIST`` expanded
the way ``scontrol show hostnames`` does, ``SLURM_NODEID``, and the fixed ``replication_port``).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping


def node_name() -> str:
    """This machine as the scheduler names it (SLURM's node name), else its host name: the one name every
    metric label, incident and exclude list uses."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class MembershipError(ValueError):
    """Peers, node rank or placement settings that cannot work; the message says which."""


@dataclass(frozen=True)
class Membership:
    peers: tuple[str, ...]  # "host:port" replication endpoints, index = node rank
    node_rank: int

    @property
    def size(self) -> int:
        return len(self.peers)

    @property
    def me(self) -> str:
        return self.peers[self.node_rank]


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist: ``gpu[01-03,7],login1`` -> gpu01 gpu02 gpu03 gpu7 login1.

    Zero padding follows the range's first bound, as SLURM does; several bracket groups in one name
    (``r[1-2]n[1-2]``) expand as a product, left to right.
    """
    names: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        if not item:
            continue
        names.extend(_expand_one(item))
    return names


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise MembershipError(f"hostlist {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise MembershipError(f"hostlist {text!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    prefix, rest = item[:m.start()], item[m.end():]
    out = []
    for rng in m.group(1).split(","):
        rng = rng.strip()
        if re.fullmatch(r"\d+", rng):
            values = [rng]
        elif (r := re.fullmatch(r"(\d+)-(\d+)", rng)) is not None:
            lo, hi = r.group(1), r.group(2)
            if int(hi) < int(lo):
                raise MembershipError(f"hostlist range {rng!r} in {item!r} runs backwards")
            width = len(lo)
            values = [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
        else:
            raise MembershipError(f"hostlist {item!r}: bad range {rng!r}")
        for v in values:
            out.extend(_expand_one(prefix + v + rest))
    return out


def from_config(peers: list[str], node_rank: int | None, replication_port: int,
                environ: Mapping[str, str]) -> Membership | None:
    """Membership from explicit peers, else from SLURM's environment, else None (single node, no peers)."""
    if peers:
        endpoints = [_endpoint(p, replication_port) for p in peers]
        rank = node_rank
        if rank is None and "SLURM_NODEID" in environ:
            rank = int(environ["SLURM_NODEID"])
        if rank is None:
            raise MembershipError("peers are set but node_rank is not (set node_rank or run under SLURM)")
    elif environ.get("SLURM_JOB_NODELIST") and int(environ.get("SLURM_JOB_NUM_NODES", "2")) > 1:
        endpoints = [f"{h}:{replication_port}" for h in expand_hostlist(environ["SLURM_JOB_NODELIST"])]
        rank = node_rank if node_rank is not None else int(environ.get("SLURM_NODEID", "0"))
    else:
        return None
    if len(set(endpoints)) != len(endpoints):
        raise MembershipError(f"peers list has duplicates: {endpoints}")
    if not 0 <= rank < len(endpoints):
        raise MembershipError(f"node_rank {rank} is outside the {len(endpoints)} peers")
    return Membership(tuple(endpoints), rank)


def _endpoint(peer: str, default_port: int) -> str:
    host, sep, port = peer.rpartition(":")
    if not sep:
        return f"{peer}:{default_port}"
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MembershipError(f"peer {peer!r} is not host:port")
    return peer


def replica_targets(node_rank: int, size: int, factor: int, jump: int = 1) -> list[int]:
    """Nodes that hold copies of ``node_rank``'s parts: a ring walked in steps of ``jump``.

    As nvidia-resiliency-ext's ``replication_jump``: with nodes packed 8 to a rack, jump=8 puts each copy
    in another rack, outside the node's failure domain.
    """
    if factor <= 0:
        return []
    if factor >= size:
        raise MembershipError(f"replication_factor {factor} needs more than {size} nodes")
    targets: list[int] = []
    for shift in range(size):  # when a ring of jumps closes (gcd(jump, size) > 1), walk the next one
        for k in range(1, size + 1):
            t = (node_rank + shift + k * jump) % size
            if t != node_rank and t not in targets:
                targets.append(t)
            if len(targets) == factor:
                return targets
    if len(targets) < factor:
        raise MembershipError(f"replication_jump {jump} reaches only {len(targets)} other nodes of {size}")
    return targets
