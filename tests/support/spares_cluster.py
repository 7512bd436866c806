"""The multi-node harness with spare nodes: 3 job nodes of 2 ranks each plus spares, each its own ``rlsup run``
on 127.0.0.1 in its own directory, peers listing all of them and ``--spares k``; torchrun as users type it
(c10d, ``--nnodes 3``). Also what the nodes held when one was lost, and how long the recovery took."""

from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path
from typing import Sequence

from rlsup_format.manifest import list_step_dirs, manifest_name
from support.cluster import Cluster, replica_ns, trainer_starts
from support.env import PY
from support.waits import wait_for

JOB_NODES = 3
RANKS_PER_NODE = 2


class SpareCluster(Cluster):
    """:class:`Cluster` with ``spares`` more processes (node ranks 3, 4, ...) that hold no ranks at first.
    ``job_nodes`` and ``ranks_per_node`` (default 3 of 2): fewer where the counts are not a test's subject (each
    rank and each node's torchrun is one more process importing torch); :func:`ranks_of` knows the default only."""

    def __init__(self, root: Path, spares: int = 1, extra: Sequence[str] = (), takeover_s: float = 1.0,
                 warm_launcher: bool = True, job_nodes: int = JOB_NODES, ranks_per_node: int = RANKS_PER_NODE,
                 **kw: object) -> None:
        self.job_nodes, self.ranks_per_node = job_nodes, ranks_per_node
        super().__init__(root, job_nodes + spares,  # type: ignore[arg-type]
                         extra=["--spares", str(spares), "--spare-takeover-s", str(takeover_s), *extra],
                         warm_launcher=warm_launcher, **kw)  # on by default: its tests assert warm takeovers

    def launcher(self, node: int) -> list[str]:
        """c10d as users type it, or static with the node rank each process was started with (a spare's is 3
        or more: rlsup rewrites it to the rank the spare takes)."""
        common = [PY, "-m", "torch.distributed.run", "--nnodes", str(self.job_nodes), "--nproc-per-node",
                  str(self.ranks_per_node)]
        if self.rdzv == "static":
            return [*common, "--node-rank", str(node), "--master-addr", self.hosts[0], "--master-port",
                    str(self.master_port)]
        return [*common, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts[0]}:{self.master_port}",
                "--rdzv-id", "job1"]


def ranks_of(slot: int) -> list[int]:
    return [slot * RANKS_PER_NODE + i for i in range(RANKS_PER_NODE)]


def replicated(cluster: Cluster, holder: int, owner: int, step: int) -> bool:
    """Node ``holder`` holds every part of ``owner``'s ranks at ``step``."""
    d = replica_ns(cluster.node_dir(holder) / "replicas", owner) / f"step_{step:09d}"
    return all((d / manifest_name(r)).exists() for r in ranks_of(owner))


def newest_complete(cluster: Cluster, lost: int, holder: int, alive: Sequence[int]) -> int:
    """The newest step whose every part survived ``lost``'s loss: the ``alive`` nodes' own, ``holder``'s replicas."""
    steps = {s for s, _ in list_step_dirs(replica_ns(cluster.node_dir(holder) / "replicas", lost))
             if replicated(cluster, holder, lost, s)}
    for node in alive:
        steps &= {s for s, d in list_step_dirs(cluster.node_dir(node) / "checkpoints")
                  if all((d / manifest_name(r)).exists() for r in ranks_of(node))}
    return max(steps, default=0)


def took_rank(log: str) -> int | None:
    """The node rank a spare said it took (None: it took none)."""
    m = re.search(r"spare \S+: took node rank (\d+)", log)
    return int(m.group(1)) if m else None


def takeover_start(log: str) -> list[str]:
    """How the spare's first launched attempt after taking a rank started, as its log says: the warm launcher's
    line (or why it was not used) and the warm ranks' (how many became workers, or why one launched cold)."""
    after = log[log.find("took node rank"):]
    launches = list(re.finditer(r"attempt (\d+): launching", after))
    if not launches:
        return []
    end = launches[1].start() if len(launches) > 1 else len(after)
    own = f"attempt {launches[0].group(1)}: "
    return [line for line in after[launches[0].start():end].splitlines()
            if own + "started by the warm launcher" in line or own + "warm launcher" in line
            or "[rlsup] warm ranks: " in line]


def logged_at(log: str, pattern: str) -> float | None:
    """The wall-clock time (epoch seconds) of the first rlsup log line matching ``pattern``."""
    m = re.search(r"^(\S+Z) .*" + pattern, log, re.M)
    return datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp() if m else None


def first_step_after(cluster: Cluster, node: int, starts_before: int, timeout: float) -> float:
    """The wall-clock time at which node ``node``'s rank 0 was seen starting the next attempt (every rank's
    first step is a collective right after it)."""
    wait_for(lambda: len(trainer_starts(cluster.log(node))) > starts_before, timeout,
             f"node {node}'s rank 0 to start the next attempt", interval=0.05)
    return time.time()
