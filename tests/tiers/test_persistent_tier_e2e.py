"""The end-to-end half of test_persistent_tier.py (real processes, or waits on real time): the persistent tier:
verified copies out and back, retention, corruption, bandwidth, and a resume from the persistent tier after the
local checkpoint directory was wiped (bit-identical weights)."""

from __future__ import annotations



import shutil
import subprocess
import sys
from pathlib import Path

import torch

from support.env import ROOT, clean_env
from support.waits import wait_for
from supervisor.tiers.persistent import PersistentTier
from supervisor.tiers.selection import choose_across_tiers
from test_persistent_tier import save_steps


TRAIN = r"""
import argparse, os, random, sys
import numpy as np, torch
from torch import nn
sys.path.insert(0, os.environ["RLSUP_ROOT"])
from trainer_hooks import CheckpointManager, heartbeat

p = argparse.ArgumentParser()
p.add_argument("--dir"); p.add_argument("--steps", type=int); p.add_argument("--every", type=int, default=5)
p.add_argument("--out")
a = p.parse_args()
random.seed(1); np.random.seed(1); torch.manual_seed(1)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
ckpt = CheckpointManager(a.dir, keep_last=2, async_save=True)
state = {"model": model, "optimizer": opt, "scheduler": sched}
step = ckpt.restore(state)
while step < a.steps:
    x = torch.randn(16, 8)
    noise = float(np.random.standard_normal()) * 1e-3 + random.random() * 1e-3
    loss = ((model(x) + noise) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    step += 1
    heartbeat(step)
    if step % a.every == 0:
        ckpt.save(step, state)
ckpt.wait()
torch.save(model.state_dict(), a.out)
"""


def test_wiped_local_resumes_from_persistent_bit_identical(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = clean_env(RLSUP_ROOT=str(ROOT))

    def train(ckpt: Path, steps: int, out: Path, **extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), "--dir", str(ckpt), "--steps", str(steps),
                                 "--out", str(out)], env={**env, **extra}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def finish(proc: subprocess.Popen) -> None:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]

    reference = train(tmp_path / "ref", 30, tmp_path / "ref.pt")  # the uninterrupted run, concurrently
    local, dest = tmp_path / "local", tmp_path / "persistent"
    tier = PersistentTier(dest, keep_last=2)
    tier.start(local, interval=0.05)  # copies in the background while the trainer saves asynchronously
    try:
        finish(train(local, 20, tmp_path / "first.pt"))
        wait_for(lambda: 20 in tier.steps(), 30, "step 20 in the persistent tier")
    finally:
        tier.stop()
    assert tier.latest_valid().step == 20
    shutil.rmtree(local)  # the local disk is gone
    point = choose_across_tiers(local, tier)
    assert (point.step, point.tier) == (20, "persistent")
    finish(train(local, 30, tmp_path / "final.pt", RLSUP_RESUME_DIR=str(point.path)))
    finish(reference)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert ref.keys() == final.keys()
    for k in ref:
        assert torch.equal(ref[k], final[k]), f"{k} differs from the uninterrupted run"


# ------------------------------------------------------------ symlinks are never copied (issue #9)


def test_protect_during_a_forked_pass_waits_for_it_and_is_not_undone_by_its_copy_back(tmp_path: Path) -> None:
    """A restore protects the step it is about to fetch while a pass is copying: the pass's retention read the
    protected step when it was forked, so protect() returns once that pass (and its copy-back) is over; what it
    set is not among what a pass copies back, so the next retention sees it."""
    import threading

    from supervisor.bounded_calls import child_pids

    local, dest = tmp_path / "local", tmp_path / "persistent"
    save_steps(local, [1])
    tier = PersistentTier(dest, keep_last=1, source=local, bandwidth=2e6)
    assert tier._loop.call(tier.poll) == 1
    save_steps(local, [2], size=1_000_000)  # ~4 MB at 2 MB/s: a pass of about 2 s
    before = child_pids()
    passing = threading.Thread(target=lambda: tier._loop.call(tier.poll), daemon=True)
    passing.start()
    wait_for(lambda: child_pids() - before, 20, "the pass to be forked")
    tier.protect(2)
    assert not passing.is_alive(), "protect() returned while a pass with the old protected step was running"
    assert tier._protected == {2} and tier._retained_protect != tier._protect_changes  # retention is due
    assert tier._loop.call(tier.poll) is None and tier._retained_protect == tier._protect_changes
    assert tier.steps() == [2]

