"""A persistent tier whose newest step answers EIO (issue 32): a restore treats the failing step as missing
and resumes from an older complete step, never from the torn one. Real rlsup, torchrun (gloo, CPU) and
examples/train_tiny.py, the tier on a FUSE mount (tests/support/sick_fs.py) told to fail one step's reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.env import PY, TRAIN
from support.procs import run_rlsup
from support.sick_fs import SickFs, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--max-restarts", "2", "--poll-interval", "0.1"]


def run(workdir: Path, tier: Path, steps: int) -> str:
    ckpt = workdir / "ckpt"
    r = run_rlsup(["run", *FAST, "--checkpoint-dir", str(ckpt), "--persistent-dir", str(tier), "--",
                   PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TRAIN,
                   "--steps", str(steps), "--checkpoint-every", "2", "--step-time", "0.01"],
                  workdir, timeout=180, OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="0")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_eio_on_the_tiers_newest_step_resumes_an_older_complete_one(tmp_path: Path) -> None:
    with SickFs(tmp_path / "backing", tmp_path / "mnt", tmp_path / "sick") as sick:
        run(tmp_path, sick.mountpoint, 8)
        steps = sorted(p.name for p in sick.root.glob("*/step_*"))
        assert steps and steps[-1].endswith("8"), steps
        shutil.rmtree(tmp_path / "ckpt")  # this node's disk is gone: only the tier holds the run
        sick.eio(match=steps[-1])  # every call on the newest step fails with EIO
        out = run(tmp_path, sick.mountpoint, 10)
        assert sick.status()["eio"] > 0, "the restore never touched the failing step"
        older = int(steps[-2].split("_")[-1])
        assert f"from step {older} " in out, out[-3000:]
        assert "from step 8 " not in out
