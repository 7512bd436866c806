"""A multi-node restart with the persistent tier hung (issue 32, review): node 0 plans the round without a tier
that does not answer, so the restart goes on from local and peer parts. Real rlsup, two nodes (c10d), torchrun
(gloo, CPU) and examples/train_tiny.py; the persistent directory on a FUSE mount (tests/support/sick_fs.py) told
to hang every call. Without the fix node 0's plan read the tier on its run loop and the round never ended.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from rlsup_format.manifest import list_step_dirs, manifest_name
from support.cluster import Cluster, rlsup_resumes
from support.sick_fs import SickFs, unavailable
from support.waits import wait_for
from trainer_hooks.heartbeat import rank_file_name, read_record

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

TRAIN = ["--steps", "2000", "--checkpoint-every", "3", "--step-time", "0.1", "--keep-last", "100"]


def own_parts(cluster: Cluster, node: int) -> list[int]:
    """The steps of which node ``node``'s checkpoint directory holds its own rank's part (rank = node here)."""
    root = cluster.node_dir(node) / "checkpoints"
    return [s for s, d in list_step_dirs(root) if (d / manifest_name(node)).exists()] if root.is_dir() else []


def test_a_restart_with_the_persistent_tier_hung_launches_from_local_parts(tmp_path: Path) -> None:
    (tmp_path / "cluster").mkdir()
    with SickFs(tmp_path / "backing", tmp_path / "mnt", tmp_path / "sick") as sick:
        cluster = Cluster(tmp_path / "cluster", 2, "c10d", ["--job-name", "mn-hung", "--persistent-dir",
                                                             str(tmp_path / "mnt"), "--persistent-every", "3"], TRAIN)
        cluster.start_all()
        try:
            wait_for(lambda: all(own_parts(cluster, n) for n in range(2)), 120, "a local part on every node",
                     interval=0.2)
            sick.hang()  # every call: a server gone
            hb = cluster.node_dir(1) / ".rlsup" / "attempts" / "attempt_0000" / "heartbeats" / rank_file_name(1)
            os.kill(read_record(hb).pid, signal.SIGKILL)
            wait_for(lambda: all(len(rlsup_resumes(cluster.log(n))) >= 2 for n in range(2)), 90,
                     "attempt 1 launched on both nodes", interval=0.3)
            assert "persistent tier not consulted for the plan" in cluster.log(0), cluster.logs()
            assert all(r is not None for n in range(2) for r in rlsup_resumes(cluster.log(n))[1:]), cluster.logs()
        except BaseException:
            print(cluster.logs())
            raise
        finally:
            sick.heal()
            cluster.kill_all()
