"""A restart's fetch from the persistent tier that the restart gave up on (issue 32, review): the tier hung
mid-fetch, the restart resumed from the older local step, then the mount answered again. The late fetch must
leave nothing in the checkpoint directory: a ``step_N`` there would sit beside the new attempt's own save of
step N (one step, parts of two runs). The tier is on a FUSE mount (tests/support/sick_fs.py) told to hang the
reads of the step's shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlsup_format.manifest import step_dir_name
from supervisor.tiers.fetch_staging import PREFIX
from supervisor.tiers.persistent import PersistentTier
from supervisor.tiers.selection import choose_across_tiers
from support.sick_fs import SickFs, unavailable
from support.waits import wait_for
from trainer_hooks import CheckpointManager

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def save_steps(ckpt: Path, steps: list[int]) -> None:
    mgr = CheckpointManager(ckpt)
    for s in steps:
        mgr.save(s, {"w": torch.full((1000,), float(s)), "step": s})


def test_a_fetch_released_after_the_restart_gave_up_leaves_no_step(tmp_path: Path) -> None:
    source, ckpt = tmp_path / "source", tmp_path / "ckpt"
    with SickFs(tmp_path / "backing", tmp_path / "mnt", tmp_path / "sick") as sick:
        tier = PersistentTier(tmp_path / "mnt", source=source)
        save_steps(source, [8])
        assert tier.poll() == 8
        save_steps(ckpt, [4])  # the local directory's newest: older than the tier's
        tier.reads.deadline_s = 1.0  # the restart gives up sooner than STALL_S (10 s)
        sick.hang(match=".pt", ops=("read",))  # the shard's bytes never come: the fetch stops mid-copy
        try:
            resume = choose_across_tiers(ckpt, tier)
            assert resume is not None and (resume.step, resume.tier) == (4, "local")
            assert tier.reads.blocked_since is not None  # the fetch is still held in the mount
        finally:
            sick.heal()
        wait_for(lambda: tier.reads.blocked_since is None, 30, "the abandoned fetch to return")
        assert not (ckpt / step_dir_name(8)).exists()
        assert not [p for p in ckpt.iterdir() if p.name.startswith(PREFIX)]  # its staging directory removed
