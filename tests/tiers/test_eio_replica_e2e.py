"""Replicas and tiers that answer EIO (issue 32), on a FUSE mount (tests/support/sick_fs.py) told to fail:
a part fetched from a holder whose reads fail comes from the next holder, and is never valid from the failing
one (supervisor.tiers.part_protocol.fetch_part, the call every restore makes); a persistent tier whose newest
step fails resumes an older complete step, never the torn one (real rlsup, torchrun with gloo on CPU,
examples/train_tiny.py)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from rlsup_format.digest import copy_hashing
from rlsup_format.manifest import SCHEMA_VERSION, RankManifest, manifest_name, verify_step_dir
from rlsup_format.names import step_dir_name
from supervisor.tiers.part_protocol import FetchFailed, copy_part, fetch_part
from supervisor.tiers.part_stores.local import LocalStore
from support.env import PY, TRAIN
from support.procs import run_rlsup
from support.sick_fs import SickFs, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

# --max-restarts 0: neither run restarts, so neither arms a launcher for a next attempt (CONTRIBUTING.md "Suite time");
# each attempt starts as rlsup's default does, its ranks forked from one torch import
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--max-restarts", "0", "--poll-interval", "0.1"]


def write_part(root: Path, step: int, rank: int, world: int, data: bytes) -> None:
    """One rank's part of ``step`` in rlsup's layout: its file, then its manifest."""
    step_dir = root / step_dir_name(step)
    step_dir.mkdir(parents=True, exist_ok=True)
    name = f"rank_{rank:05d}.pt"
    (step_dir / name).write_bytes(data)
    m = RankManifest(SCHEMA_VERSION, step, world, rank, "test", {name: copy_hashing(io.BytesIO(data))}, 1.0)
    (step_dir / manifest_name(rank)).write_text(m.to_json())


def test_a_replica_failing_with_eio_is_replaced_by_the_next_holder_never_kept(tmp_path: Path) -> None:
    """Two holders of one part, the first on a mount whose reads fail with EIO (its listing still answers): the
    part comes from the second; with the failing holder alone the fetch fails and leaves no valid part."""
    source = LocalStore(tmp_path / "source")
    write_part(tmp_path / "source", 12, 0, 1, bytes(range(256)) * 4096)
    with SickFs(tmp_path / "backing", tmp_path / "mnt", tmp_path / "sick") as sick:
        sick_holder, good_holder = LocalStore(sick.mountpoint / "replicas"), LocalStore(tmp_path / "good")
        assert copy_part(source, sick_holder, 12, 0).written and copy_part(source, good_holder, 12, 0).written
        sick.eio(match=step_dir_name(12), ops=("read",))
        dst = LocalStore(tmp_path / "restored")
        used, _ = fetch_part([sick_holder, good_holder], dst, 12, 0)
        assert used is good_holder and sick.status()["eio"] > 0
        assert verify_step_dir(tmp_path / "restored" / step_dir_name(12)).valid
        alone = LocalStore(tmp_path / "alone")
        with pytest.raises(FetchFailed, match="Input/output error"):
            fetch_part([sick_holder], alone, 12, 0)
        assert not verify_step_dir(tmp_path / "alone" / step_dir_name(12)).valid
        assert not (tmp_path / "alone" / step_dir_name(12) / manifest_name(0)).exists()


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
        run(tmp_path, sick.mountpoint, 6)
        steps = sorted(p.name for p in sick.root.glob("*/step_*"))
        assert steps and steps[-1].endswith("6"), steps
        shutil.rmtree(tmp_path / "ckpt")  # this node's disk is gone: only the tier holds the run
        sick.eio(match=steps[-1])  # every call on the newest step fails with EIO
        out = run(tmp_path, sick.mountpoint, 8)
        assert sick.status()["eio"] > 0, "the restore never touched the failing step"
        older = int(steps[-2].split("_")[-1])
        assert f"from step {older} " in out, out[-3000:]
        assert "from step 6 " not in out
