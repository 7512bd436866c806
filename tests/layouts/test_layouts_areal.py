"""AReaL's single, overwritten-in-place recover checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from layout_builders import areal_info, areal_recover, dcp_save, largest, truncate

from supervisor import layouts


def test_missing_dcp_metadata_and_truncated_shard(tmp_path: Path) -> None:
    areal_recover(tmp_path, 40, roles=("default", "critic"))
    truncate(largest(tmp_path / "critic" / "recover_checkpoint", "*.distcp"), 0.5)
    assert "critic" in layouts.scan(tmp_path)[0].reason
    (tmp_path / "critic" / "recover_checkpoint" / ".metadata").unlink()
    assert layouts.latest_valid(tmp_path) is None


def test_step_info_torn_or_missing(tmp_path: Path) -> None:
    areal_recover(tmp_path, 40)
    info = tmp_path / "recover_info" / "step_info.json"
    info.write_text('{"epoch": 0, "glob')
    (rec,) = layouts.scan(tmp_path)
    assert not rec.valid and "step_info.json" in rec.reason
    info.unlink()
    assert layouts.latest_valid(tmp_path) is None


def test_newer_weights_under_old_step_info_are_detected(tmp_path: Path) -> None:
    """Killed after the engine's DCP save of step 50, before recover_info was dumped."""
    areal_recover(tmp_path, 40)
    info = tmp_path / "recover_info" / "step_info.json"
    past = info.stat().st_mtime_ns - 5_000_000_000
    os.utime(info, ns=(past, past))  # keep mtimes apart on coarse-clock filesystems
    dcp_save(tmp_path / "default" / "recover_checkpoint", seed=50)  # same shapes, same sizes
    (rec,) = layouts.scan(tmp_path)
    assert not rec.valid and "saved after step_info.json" in rec.reason
    areal_info(tmp_path, 50)  # the dump completes
    assert layouts.latest_valid(tmp_path).step == 50


def test_shards_rewritten_after_metadata(tmp_path: Path) -> None:
    """An overwrite in progress: a shard already rewritten, .metadata still the old one."""
    areal_recover(tmp_path, 40)
    ckpt = tmp_path / "default" / "recover_checkpoint"
    meta = ckpt / ".metadata"
    past = meta.stat().st_mtime_ns - 5_000_000_000
    os.utime(meta, ns=(past, past))
    os.utime(tmp_path / "recover_info" / "step_info.json", ns=(past, past))
    shard = largest(ckpt, "*.distcp")
    shard.write_bytes(shard.read_bytes())  # same size, new mtime
    (rec,) = layouts.scan(tmp_path)
    assert not rec.valid and "newer than .metadata" in rec.reason


def test_the_launchers_empty_recover_dir_under_recover_info_is_no_model(tmp_path: Path) -> None:
    """AReaL's check_if_auto_recover makes recover_info/recover_checkpoint/ (empty) at every launch with
    recover.mode=auto; it is not a model whose checkpoint is missing."""
    areal_recover(tmp_path, 40)
    (tmp_path / "recover_info" / "recover_checkpoint").mkdir()
    rec = layouts.latest_valid(tmp_path)
    assert rec is not None and rec.step == 40, layouts.scan(tmp_path)[0].reason
    assert "roles: default" in rec.notes


def test_dump_killed_after_step_info_is_detected(tmp_path: Path) -> None:
    """RecoverInfo.dump writes step_info.json first, then the other states: killed right after it, the
    new step sits beside the previous save's dataloader and saver states."""
    areal_recover(tmp_path, 40)
    info = tmp_path / "recover_info"
    past = info.joinpath("step_info.json").stat().st_mtime_ns - 5_000_000_000
    for f in info.iterdir():
        os.utime(f, ns=(past, past))  # the save before, seconds ago
    dcp_save(tmp_path / "default" / "recover_checkpoint", seed=50)
    (info / "step_info.json").write_text('{"epoch": 0, "epoch_step": 50, "global_step": 50, "steps_per_epoch": 1000}')
    (rec,) = layouts.scan(tmp_path)
    assert not rec.valid and rec.step == 50, rec
    assert "dataloader_info.pkl older than step_info.json" in rec.reason
    areal_info(tmp_path, 50)  # the dump completes
    assert layouts.latest_valid(tmp_path).step == 50
