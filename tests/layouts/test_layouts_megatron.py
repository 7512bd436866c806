"""Megatron-Core / Megatron-Bridge iter_N trees written by megatron-core's dist_checkpointing.save."""

from __future__ import annotations

from pathlib import Path

import pytest
import layout_builders as lb
from layout_builders import megatron_iter, truncate, write_tracker

from supervisor import layouts


@pytest.fixture(scope="module", autouse=True)
def template() -> Path:
    return lb.mcore_dist_template()


def test_core_missing_dcp_metadata(tmp_path: Path) -> None:
    megatron_iter(tmp_path, 1)
    i2 = megatron_iter(tmp_path, 2)
    (i2 / ".metadata").unlink()
    assert ".metadata missing" in layouts.verify_path(i2).reason
    assert layouts.latest_valid(tmp_path).step == 1


def test_empty_iter_dir(tmp_path: Path) -> None:
    megatron_iter(tmp_path, 1)
    (tmp_path / "iter_0000002").mkdir()
    assert layouts.latest_valid(tmp_path).step == 1


def test_bridge_needs_train_state_and_run_config(tmp_path: Path) -> None:
    megatron_iter(tmp_path, 10, bridge=True)
    i20 = megatron_iter(tmp_path, 20, bridge=True)
    i30 = megatron_iter(tmp_path, 30, bridge=True)
    (i20 / "run_config.yaml").unlink()  # Bridge finalize killed after moving the tracker
    truncate(i30 / "train_state.pt", 0.4)
    assert "run_config.yaml missing" in layouts.verify_path(i20).reason
    assert "train_state.pt" in layouts.verify_path(i30).reason
    assert layouts.latest_valid(tmp_path).step == 10


def test_tracker_names_deleted_iteration(tmp_path: Path) -> None:
    megatron_iter(tmp_path, 5)
    write_tracker(tmp_path, 9)
    st = layouts.tracker_status(tmp_path)
    assert st.step == 9 and st.step_valid is False and not st.ok
    assert layouts.latest_valid(tmp_path).step == 5


def test_bridge_tracker_cut_between_its_two_files_is_repaired(tmp_path: Path) -> None:
    """Bridge copies train_state.pt to latest_train_state.pt, then writes the text tracker: killed between
    them, the text tracker still names the valid step 20 but Bridge (which reads latest_train_state.pt
    first) would load step 30, whose finalize never finished."""
    megatron_iter(tmp_path, 10, bridge=True)
    i20 = megatron_iter(tmp_path, 20, bridge=True)
    i30 = megatron_iter(tmp_path, 30, bridge=True, tracker=False)
    (i30 / "run_config.yaml").unlink()
    status = layouts.tracker_status(tmp_path)
    assert status.step == 20 and status.step_valid and not status.ok
    assert "latest_train_state.pt is not iter_0000020's train_state.pt" in status.describe()
    layouts.repair_tracker(tmp_path, 20)
    assert (tmp_path / "latest_train_state.pt").read_bytes() == (i20 / "train_state.pt").read_bytes()
    assert layouts.tracker_status(tmp_path).ok
    truncate(tmp_path / "latest_train_state.pt")  # a torn copy: Bridge's torch.load would fail on it
    assert "torn, or another step's" in layouts.tracker_status(tmp_path).describe()


def test_no_megatron_tracker_is_created_from_nothing(tmp_path: Path) -> None:
    """Killed in its first save after MCore finished but before any Bridge file: the step looks like a
    complete plain MCore step, which Bridge cannot load. rlsup leaves the directory without a tracker
    (the trainer starts fresh, as it would alone)."""
    megatron_iter(tmp_path, 10, tracker=False)
    assert layouts.latest_valid(tmp_path).step == 10
    with pytest.raises(ValueError, match="keeps no tracker yet"):
        layouts.repair_tracker(tmp_path, 10)
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()


def test_repair_tracker_keeps_previous_and_updates_bridge_state(tmp_path: Path) -> None:
    megatron_iter(tmp_path, 10, bridge=True)
    i20 = megatron_iter(tmp_path, 20, bridge=True)
    (i20 / "run_config.yaml").unlink()
    old_state = (tmp_path / "latest_train_state.pt").read_bytes()
    path = layouts.repair_tracker(tmp_path, 10)
    assert path.read_text() == "10"
    assert (tmp_path / "latest_checkpointed_iteration.txt.rlsup-prev").read_text() == "20"
    assert (tmp_path / "latest_train_state.pt").read_bytes() == (tmp_path / "iter_0000010" / "train_state.pt").read_bytes()
    assert (tmp_path / "latest_train_state.pt.rlsup-prev").read_bytes() == old_state
    assert layouts.tracker_status(tmp_path).ok
    with pytest.raises(ValueError, match="not valid"):
        layouts.repair_tracker(tmp_path, 20)
    with pytest.raises(ValueError, match="no step"):
        layouts.repair_tracker(tmp_path, 99)
    assert not list(tmp_path.glob(".latest*tmp"))


def test_bridge_energon_loader_state_must_be_intact(tmp_path: Path) -> None:
    """Bridge saves Energon's per-DP-rank loader state to <save>/energon/iter_N/; a torn one fails its load."""
    megatron_iter(tmp_path, 10, bridge=True)
    megatron_iter(tmp_path, 20, bridge=True)
    import torch

    for step in (10, 20):
        d = tmp_path / "energon" / f"iter_{step:07d}"
        d.mkdir(parents=True)
        torch.save({"step": step}, d / "train_dataloader_dprank000.pt")
    assert layouts.latest_valid(tmp_path).step == 20
    truncate(tmp_path / "energon" / "iter_0000020" / "train_dataloader_dprank000.pt")
    assert layouts.latest_valid(tmp_path).step == 10
    bad = [r for r in layouts.scan(tmp_path) if r.step == 20][0]
    assert "energon/iter_0000020/train_dataloader_dprank000.pt" in bad.reason


