"""The persistent tier in multi-node runs: per-part copies out, restore through the round plan.

Unit level (no torchrun): two nodes' supervisors copy their own parts into one step directory of a
shared tier (filesystem and fsspec), the step becomes valid only with the last manifest, killed copies
leave nothing that looks valid and their temp files are cleaned up, retention prunes only whole old
steps, and a corrupted part is refused on fetch.

End to end: two node supervisors on 127.0.0.1 around a 2-node torchrun job with a shared persistent
directory. Every node is SIGKILLed and loses its checkpoint directory and replica store; restarted,
the nodes resume from the tier's newest valid step (or, when that step's part is corrupted, the next
older valid one) and end bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from rlsup_format.manifest import hash_file, manifest_name, step_dir_name, verify_step_dir
from rlsup_format.names import host_tag
from support.cluster import Cluster, assert_same_weights, job_subdir, reference_weights
from support.waits import wait_for
from supervisor.tiers.holdings import TierOffer
from supervisor.tiers.part_protocol import FetchFailed, fetch_part
from supervisor.tiers.part_stores.local import LocalStore
from supervisor.tiers.persistent import PersistentTier
from trainer_hooks import CheckpointManager

NODES = 2
STEPS = 36
TRAIN_ARGS = ["--steps", str(STEPS), "--checkpoint-every", "3", "--step-time", "0.2", "--keep-last", "100"]


# ------------------------------------------------------------------------------------------ unit level


def save_part(root: Path, step: int, rank: int, world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Write rank ``rank``'s part of ``step`` as node ``rank`` would (one rank per node)."""
    with monkeypatch.context() as m:
        m.setenv("RANK", str(rank))
        m.setenv("WORLD_SIZE", str(world))
        m.setenv("RLSUP_NODE_RANK", str(rank))
        CheckpointManager(root).save(step, {"w": torch.full((2000,), float(step * 10 + rank))})


def flip_tier_byte(tier: PersistentTier, step: int, rel: str) -> None:
    data = bytearray(tier.store.reader(step).read(rel))
    data[len(data) // 2] ^= 0xFF
    if tier.location.startswith("memory://"):
        tier.store.fs.pipe_file(f"{tier.store.path(step)}/{rel}", bytes(data))
    else:
        (tier.store.path(step) / rel).write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["fs", "fsspec"])
def test_per_part_copy_out_retention_and_fetch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    if kind == "fsspec":
        pytest.importorskip("fsspec")
        url = f"memory://rlsup-mn-{os.getpid()}-{time.monotonic_ns()}/tier"
    else:
        url = str(tmp_path / "tier")
    n0, n1 = tmp_path / "n0", tmp_path / "n1"
    tier0 = PersistentTier(url, keep_last=2, node=0)
    tier1 = PersistentTier(url, keep_last=2, node=1)
    for step in (3, 6):
        save_part(n0, step, 0, 2, monkeypatch)
        save_part(n1, step, 1, 2, monkeypatch)

    assert tier1.poll(n1) is None and tier1.steps() == []  # node 0 starts steps; node 1 only joins
    assert tier0.poll(n0) == 6  # its newest own part
    assert tier0.steps() == [6] and not tier0.verify(6)  # rank 1's manifest missing: not valid yet
    assert tier1.poll(n1) == 6  # joins the started step
    assert tier0.verify(6, full=True)  # valid exactly when every rank's manifest is there

    for step in (9, 12, 15, 18):
        save_part(n0, step, 0, 2, monkeypatch)
        save_part(n1, step, 1, 2, monkeypatch)
        tier0.poll(n0)
        tier1.poll(n1)
    tier0.poll(n0)  # every new step (no cadence set); node 0 prunes all but the newest 2 valid
    assert tier0.steps() == [15, 18] and all(tier0.verify(s) for s in (15, 18))
    tier1.poll(n1)
    assert tier1.steps() == [15, 18]

    # A node killed mid-copy: node 1's data file of step 21 is there, its manifest is not.
    for root, rank in ((n0, 0), (n1, 1)):
        save_part(root, 21, rank, 2, monkeypatch)
    assert tier0.poll(n0) == 21
    rel = "rank_00001.pt"
    src = n1 / step_dir_name(21) / rel
    with open(src, "rb") as f:
        tier1.store.put_file(21, rel, f, hash_file(src))
    assert not tier0.verify(21)  # a partial part never looks valid
    assert tier0.part_listing()[21].ranks == {0}  # and is not offered for a restore
    if kind == "fs":
        # Temp files of killed copies: this host's dead pid goes at once, another host's after STALE_AGE_S.
        step_dir = tier0.store.path(21)
        dead = step_dir / f".tmp-copy-{host_tag()}-999999999-dead"  # rlsup_format.names reserved names
        other_old = step_dir / ".tmp-copy-otherhost-123-old"
        other_new = step_dir / ".tmp-copy-otherhost-123-new"
        for p in (dead, other_old, other_new):
            p.write_bytes(b"partial")
        os.utime(other_old, (time.time() - 7200, time.time() - 7200))
        tier1._last_clean = None
    assert tier1.poll(n1) == 21 and tier0.verify(21, full=True)
    if kind == "fs":
        assert not dead.exists() and not other_old.exists() and other_new.exists()

    # Restore: the listing offers whole parts with their owners; the multi-node restore's fetch (the tier's
    # store as a holder, as the round's plan names it) verifies before the manifest.
    listing = tier0.part_listing()
    assert listing == {21: TierOffer(2, frozenset({0, 1}), {0: 0, 1: 1})}
    used, _ = fetch_part([tier0.store], LocalStore(tmp_path / "restore"), 21, 1)
    got = tmp_path / "restore" / step_dir_name(21)
    assert used is tier0.store and (got / manifest_name(1)).exists()
    assert not any(p.name.startswith(".staging-") for p in got.iterdir())
    flip_tier_byte(tier0, 21, rel)
    assert tier0.part_listing(exclude={(21, 1)})[21].ranks == {0}
    with pytest.raises(FetchFailed) as failed:  # the tier's copy is invalid: the plan stops offering it
        fetch_part([tier0.store], LocalStore(tmp_path / "restore2"), 21, 1)
    assert failed.value.invalid == [tier0.store]
    bad_dir = tmp_path / "restore2" / step_dir_name(21)
    assert not (bad_dir / manifest_name(1)).exists() and not any(bad_dir.iterdir())
    # Node 1 (a new process: nothing remembered) finds its own part invalid and rewrites it; node 0's
    # valid part is never touched.
    rank0_manifest = tier0.store.reader(21).read(manifest_name(0))
    fresh1 = PersistentTier(url, keep_last=2, node=1)
    assert fresh1.poll(n1) == 21
    assert tier0.verify(21, full=True) and tier0.store.reader(21).read(manifest_name(0)) == rank0_manifest


# ------------------------------------------------------------------------------------------ end to end


class PersistentCluster(Cluster):
    """Two `rlsup run` node supervisors (static rendezvous) sharing one persistent directory."""

    def __init__(self, root: Path) -> None:
        self.persistent = root / "persistent"
        # A new allocation on other addresses (new ports, see new_ports) is the same job only by name (or
        # SLURM_JOB_ID): without one, the identity includes the peers.
        super().__init__(root, NODES, "static", ["--job-name", "mn-persistent", "--persistent-dir", str(self.persistent),
                                                  "--persistent-every", "6", "--persistent-keep-last", "3"],
                         TRAIN_ARGS, scan_interval=0.3)

    def wipe_nodes(self) -> None:
        """Every node loses its disk: checkpoint directory and replica store."""
        for node in range(NODES):
            shutil.rmtree(self.node_dir(node) / "checkpoints", ignore_errors=True)
            shutil.rmtree(self.node_dir(node) / "replicas", ignore_errors=True)

    def valid_persistent_steps(self) -> list[int]:
        tier = PersistentTier(job_subdir(self.persistent))
        return [s for s in tier.steps() if tier.verify(s, full=True)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final weights (same world size, no supervisor)."""
    return reference_weights(tmp_path_factory.mktemp("reference"), NODES, TRAIN_ARGS)


def run_until_persisted(cluster: PersistentCluster, min_step: int,
                        resumed: Callable[[], bool] = lambda: True) -> list[int]:
    """Start every node, wait until ``resumed()`` and a valid persistent step >= ``min_step``, then lose every
    node."""
    cluster.start_all()
    try:
        wait_for(resumed, 120, "every node resumed as expected", interval=0.2)
        wait_for(lambda: any(s >= min_step for s in cluster.valid_persistent_steps()), 120,
                 f"a valid persistent step >= {min_step}", interval=0.2)
    except AssertionError:
        cluster.kill_all()
        raise AssertionError(cluster.logs()) from None
    cluster.kill_all()
    assert all(proc.returncode != 0 for proc in cluster.procs.values()), "the run ended before the kill"
    cluster.wipe_nodes()
    return cluster.valid_persistent_steps()  # after the kill: nothing changes any more


def restart_and_finish(cluster: PersistentCluster) -> None:
    cluster.new_ports()
    cluster.start_all()
    try:
        codes = cluster.wait_all(timeout=150)
    finally:
        cluster.kill_all()
    assert codes == {n: 0 for n in range(NODES)}, cluster.logs()


def test_all_nodes_lost_twice_resume_from_the_tier_and_past_a_corrupted_part_bit_identical(
        tmp_path: Path, reference: dict) -> None:
    """Every node loses its disk twice. The first time the tier's newest step has a corrupted part: the
    round plans again without it and every node resumes from the next older valid step. The second time
    the tier is intact: every node resumes from its newest step. The run ends bit-identical (a wrong
    resume at either loss would show in the final weights)."""
    cluster = PersistentCluster(tmp_path)
    valid = run_until_persisted(cluster, 9)
    newest = max(valid)
    older = [s for s in valid if s < newest]
    shard = job_subdir(cluster.persistent) / step_dir_name(newest) / "rank_00001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert not verify_step_dir(job_subdir(cluster.persistent) / step_dir_name(newest)).valid

    cluster.new_ports()
    expected = (max(older), "persistent") if older else (None, None)
    valid = run_until_persisted(cluster, newest + 1,
                                resumed=lambda: all(resume_of(cluster, n) == expected for n in range(NODES)))
    # The bad part was found once, by the node that fetched it, and the round planned again without it.
    assert "do not verify; planning again without them" in cluster.logs(tail=None), cluster.logs()
    newest = max(valid)

    restart_and_finish(cluster)
    assert_same_weights(cluster.node_dir(0) / cluster.out_name, reference)
    for node in range(NODES):
        state = cluster.state(node)
        assert (state["resume_step"], state["resume_tier"]) == (newest, "persistent"), (state, cluster.logs())
        assert state["state"] == "succeeded"
    # Node 0 alone prunes, whole steps only, and keeps the newest 3 valid ones.
    assert len(cluster.valid_persistent_steps()) <= 3 + 1  # +1: a step completed after its last pass


def resume_of(cluster: PersistentCluster, node: int) -> tuple[int | None, str | None] | None:
    """Where node ``node``'s current attempt resumed from (None until its state.json says)."""
    try:
        state = cluster.state(node)
    except (OSError, ValueError):
        return None
    return (state.get("resume_step"), state.get("resume_tier")) if "resume_tier" in state else None
