"""The end-to-end half of test_layouts_areal.py (real processes, or waits on real time): aReaL's single,
overwritten-in-place recover checkpoint."""

from __future__ import annotations

from pathlib import Path

from layout_builders import areal_recover, truncate

from supervisor import layouts


def test_complete_recover_checkpoint(tmp_path: Path) -> None:
    areal_recover(tmp_path, 40, roles=("default", "critic"))
    assert layouts.detect_layout(tmp_path) == "areal"
    rec = layouts.latest_valid(tmp_path)
    assert rec is not None and rec.step == 40 and rec.path == tmp_path
    assert layouts.verify_path(tmp_path).valid


def test_torn_dcp_metadata_means_nothing_valid(tmp_path: Path) -> None:
    areal_recover(tmp_path, 40)
    truncate(tmp_path / "default" / "recover_checkpoint" / ".metadata", 0.5)
    assert layouts.latest_valid(tmp_path) is None
    (rec,) = layouts.scan(tmp_path)
    assert "only copy" in rec.reason


