"""The multi-node harness with spare nodes: 3 job nodes of 2 ranks each plus spares, each its own ``rlsup run``
on 127.0.0.1 in its own directory, peers listing all of them and ``--spares k``; torchrun as users type it
(c10d, ``--nnodes 3``). Also the time from a node's loss to the first step of the next attempt."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Sequence

from support.cluster import Cluster, trainer_starts
from support.env import PY
from support.waits import wait_for

JOB_NODES = 3
RANKS_PER_NODE = 2


class SpareCluster(Cluster):
    """:class:`Cluster` with ``spares`` more processes (node ranks 3, 4, ...) that hold no ranks at first."""

    def __init__(self, root: Path, spares: int = 1, extra: Sequence[str] = (), takeover_s: float = 1.0,
                 **kw: object) -> None:
        super().__init__(root, JOB_NODES + spares,
                         extra=["--spares", str(spares), "--spare-takeover-s", str(takeover_s), *extra], **kw)

    def launcher(self, node: int) -> list[str]:
        return [PY, "-m", "torch.distributed.run", "--nnodes", str(JOB_NODES), "--nproc-per-node",
                str(RANKS_PER_NODE), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{self.hosts[0]}:{self.master_port}", "--rdzv-id", "job1"]


def took_rank(log: str) -> int | None:
    """The node rank a spare said it took (None: it took none)."""
    m = re.search(r"spare \S+: took node rank (\d+)", log)
    return int(m.group(1)) if m else None


def first_step_after(cluster: Cluster, node: int, lost_at: float, starts_before: int, timeout: float) -> float:
    """Seconds from ``lost_at`` (time.monotonic) until node ``node``'s rank 0 said the next attempt started
    (every rank's first step is a collective right after it)."""
    wait_for(lambda: len(trainer_starts(cluster.log(node))) > starts_before, timeout,
             f"node {node}'s rank 0 to start the next attempt")
    return time.monotonic() - lost_at
