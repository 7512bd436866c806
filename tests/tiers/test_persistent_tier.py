"""The persistent tier: verified copies out and back, retention, corruption, bandwidth, and a resume
from the persistent tier after the local checkpoint directory was wiped (bit-identical weights)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from support.waits import wait_for
from supervisor.tiers.persistent import PersistentTier, PersistentTierError
from supervisor.tiers.selection import choose_across_tiers
from trainer_hooks import CheckpointManager
from rlsup_format.manifest import is_held, step_dir_name, verify_step_dir


def save_steps(ckpt: Path, steps: list[int], size: int = 1000) -> None:
    mgr = CheckpointManager(ckpt)
    for s in steps:
        mgr.save(s, {"w": torch.full((size,), float(s)), "step": s})


def flip_byte(step_dir: Path) -> None:
    shard = step_dir / "rank_00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)


def test_copy_verify_retention_and_fetch(tmp_path: Path) -> None:
    local, dest = tmp_path / "local", tmp_path / "persistent"
    tier = PersistentTier(dest, keep_last=2, source=local)
    assert tier.poll() is None and tier.latest_valid() is None  # nothing to copy yet
    for s in (10, 20, 30):
        save_steps(local, [s])
        assert tier.poll() == s
        assert tier.poll() is None  # already there
    assert tier.steps() == [20, 30]  # keep_last=2
    assert verify_step_dir(dest / step_dir_name(30)).valid
    assert not any(p.name.startswith(".") for p in dest.iterdir())  # no temp dirs left behind
    assert not any(is_held(p) for p in local.iterdir())  # hold markers removed after the copy
    # Retention never deletes the newest valid copy; an invalid newer one does not count.
    flip_byte(dest / step_dir_name(30))
    assert tier.latest_valid().step == 20  # the corrupted copy is never offered
    got = tier.fetch(20, tmp_path / "back")
    assert got == tmp_path / "back" / step_dir_name(20) and verify_step_dir(got).valid
    assert torch.load(got / "rank_00000.pt", weights_only=True)["w"][0].item() == 20.0
    with pytest.raises(PersistentTierError):
        tier.fetch(30, tmp_path / "back")
    assert not (tmp_path / "back" / step_dir_name(30)).exists()  # never renamed into place


def test_choose_across_tiers_wiped_local_and_corrupt_copy(tmp_path: Path) -> None:
    local, dest = tmp_path / "local", tmp_path / "persistent"
    save_steps(local, [5, 10, 15])
    tier = PersistentTier(dest, source=local)
    assert tier.poll() == 15
    save_steps(local, [20])  # newer locally, not copied: the local tier wins
    point = choose_across_tiers(local, tier)
    assert (point.step, point.tier) == (20, "local")
    shutil.rmtree(local)  # the node's disk is gone
    point = choose_across_tiers(local, tier)
    assert (point.step, point.tier, point.layout) == (15, "persistent", "rlsup")
    assert point.path == local / step_dir_name(15) and verify_step_dir(point.path).valid
    # A corrupted persistent copy is skipped in favour of an older valid one (here: the local one).
    shutil.rmtree(local)
    save_steps(local, [5])
    flip_byte(dest / step_dir_name(15))
    point = choose_across_tiers(local, tier)
    assert (point.step, point.tier) == (5, "local")
    assert not (local / step_dir_name(15)).exists()
    assert choose_across_tiers(tmp_path / "empty", None) is None


def test_cadence_every_n_and_background_thread(tmp_path: Path) -> None:
    local, dest = tmp_path / "local", tmp_path / "persistent"
    now = [0.0]
    tier = PersistentTier(dest, every_n=10, every_seconds=100.0, source=local, clock=lambda: now[0])
    save_steps(local, [3])
    assert tier.poll() == 3  # the first valid step is always copied
    save_steps(local, [6])
    assert tier.poll() is None  # 3 steps and 0 s since the last copy
    save_steps(local, [13])
    assert tier.poll() == 13  # 10 steps
    save_steps(local, [14])
    now[0] = 150.0
    assert tier.poll() == 14  # 100 s
    tier2 = PersistentTier(tmp_path / "p2")
    tier2.start(local, interval=0.05)
    try:
        wait_for(lambda: tier2.steps() == [14], 20, "the background thread to copy step 14")
        save_steps(local, [15])
        wait_for(lambda: 15 in tier2.steps(), 20, "the background thread to copy step 15")
    finally:
        tier2.stop()
    assert all(tier2.verify(s) for s in tier2.steps())


def test_bandwidth_cap(tmp_path: Path) -> None:
    local = tmp_path / "local"
    save_steps(local, [1], size=1_000_000)  # ~4 MB
    size = verify_step_dir(local / step_dir_name(1)).size_bytes
    rate = 8e6
    tier = PersistentTier(tmp_path / "p", bandwidth=rate, source=local)
    t0 = time.monotonic()
    assert tier.poll() == 1
    elapsed = time.monotonic() - t0
    burst = max(1 << 20, rate / 10)
    assert elapsed >= (size - burst) / rate * 0.9, elapsed


def test_fsspec_memory_filesystem(tmp_path: Path) -> None:
    """The fsspec path against fsspec's in-memory filesystem (a real fsspec implementation)."""
    pytest.importorskip("fsspec")
    local = tmp_path / "local"
    save_steps(local, [7, 8])
    url = f"memory://rlsup-test-{os.getpid()}/ckpts"
    tier = PersistentTier(url, keep_last=1, source=local)
    assert tier.poll() == 8
    assert tier.steps() == [8] and tier.latest_valid().step == 8
    tier.store.fs.pipe_file(f"{tier.store.path(8)}/rank_00000.pt", b"garbage")
    assert tier.latest_valid() is None  # corrupted: never offered
    with pytest.raises(PersistentTierError):
        tier.fetch(8, tmp_path / "back")
    tier.store.delete(8)
    fresh = PersistentTier(url, source=local)  # e.g. after a supervisor restart
    assert fresh.steps() == [] and fresh.poll() == 8
    got = fresh.fetch(8, tmp_path / "back")
    assert verify_step_dir(got).valid
    assert torch.load(got / "rank_00000.pt", weights_only=True)["w"][0].item() == 8.0


# ------------------------------------------------------------ symlinks are never copied (issue #9)

def test_symlinked_file_is_never_copied(tmp_path: Path) -> None:
    from supervisor.tiers.part_stores.local import LocalStore

    local, dest = tmp_path / "local", tmp_path / "persistent"
    save_steps(local, [10, 20])
    # Step 20's shard becomes a link to a file holding exactly the same bytes: size and checksum
    # match, so a copy that followed it would verify.
    shard = local / step_dir_name(20) / "rank_00000.pt"
    twin = tmp_path / "twin.pt"
    shutil.copyfile(shard, twin)
    shard.unlink()
    os.symlink(twin, shard)
    with pytest.raises(OSError, match="symbolic link"):  # rlsup_format.manifest.UnsafeFileError
        LocalStore(local).open(20, "rank_00000.pt")  # every copy reads its source through this
    tier = PersistentTier(dest, source=local)
    assert tier.poll() == 10  # the newest step that is really complete; 20 is never copied
    assert tier.steps() == [10] and not (dest / step_dir_name(20)).exists()
    # The same trap planted in the persistent copy: fetching it back refuses, nothing lands locally.
    copied = dest / step_dir_name(10) / "rank_00000.pt"
    twin10 = tmp_path / "twin10.pt"
    shutil.copyfile(copied, twin10)
    copied.unlink()
    os.symlink(twin10, copied)
    assert tier.latest_valid() is None
    with pytest.raises(PersistentTierError):
        tier.fetch(10, tmp_path / "back")
    assert not (tmp_path / "back" / step_dir_name(10)).exists()


def test_flush_copies_the_last_step_whatever_the_cadence(tmp_path: Path) -> None:
    """A run that ends (or is preempted) between two cadence points still leaves its last step in the tier."""
    ckpt, dest = tmp_path / "ckpt", tmp_path / "persistent"
    tier = PersistentTier(dest, every_n=100, source=ckpt)
    save_steps(ckpt, [1])
    assert tier.poll() == 1  # the first valid step is always due
    save_steps(ckpt, [2])
    assert tier.poll() is None  # 1 step since the last copy < every_n
    assert tier.flush(timeout=60) == 2
    assert verify_step_dir(dest / step_dir_name(2), full=True).valid
    assert tier.flush(timeout=60) is None  # nothing newer: no second copy


def test_a_cut_off_copy_is_not_taken_for_done(tmp_path: Path) -> None:
    """A new rlsup (fresh tier object) finds a copy that a killed one left without manifests: it copies
    that step again instead of skipping it as already persisted."""
    ckpt, dest = tmp_path / "ckpt", tmp_path / "persistent"
    save_steps(ckpt, [3])
    assert PersistentTier(dest, source=ckpt).poll() == 3
    for m in (dest / step_dir_name(3)).glob("manifest*"):
        m.unlink()  # as if the copy had been cut off before its manifests
    assert not verify_step_dir(dest / step_dir_name(3)).valid
    assert PersistentTier(dest, source=ckpt).poll() == 3
    assert verify_step_dir(dest / step_dir_name(3), full=True).valid


def test_a_pass_forked_while_a_fetch_holds_the_lock_completes_once_it_is_released(tmp_path: Path) -> None:
    """A fetch holds the tier's lock for the whole fetch; a pass the loop forks meanwhile must not inherit that
    lock held (its child would wait on it forever: the tier never copies again). The loop takes the lock around
    the forked pass, the child never takes it."""
    import threading

    local, dest = tmp_path / "local", tmp_path / "persistent"
    save_steps(local, [4])
    tier = PersistentTier(dest, source=local)
    assert tier._loop.keep is not None  # a tier on a filesystem: each pass is forked
    tier._lock.acquire()  # as _fetch does for a whole fetch
    released = False
    try:
        tier.start(interval=0.05)
        wait_for(lambda: tier._loop._pass_started is not None, 20, "the loop to begin a pass")
        threading.Event().wait(0.3)  # (without the fix the child is forked here, with the lock held)
        tier._lock.release()
        released = True
        wait_for(lambda: tier.steps() == [4], 30, "the pass to copy step 4 once the lock is released")
    finally:
        if not released:
            tier._lock.release()
        tier.stop(timeout=5)


