"""verl FSDP, Megatron v2 and pre-v2 trees: complete, killed mid-save, truncated, lying tracker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from layout_builders import (largest, truncate, verl_fsdp_step, verl_legacy_step, verl_megatron_step,
                             write_tracker)

from supervisor import layouts


# ------------------------------------------------------------------ FSDP

def test_fsdp_complete_steps(tmp_path: Path) -> None:
    for s in (10, 20):
        verl_fsdp_step(tmp_path, s)
    assert layouts.detect_layout(tmp_path) == "verl"
    recs = layouts.scan(tmp_path)
    assert [(r.step, r.valid) for r in recs] == [(10, True), (20, True)]
    assert layouts.latest_valid(tmp_path).step == 20
    assert layouts.tracker_status(tmp_path).ok


def test_fsdp_missing_rank_file_falls_back(tmp_path: Path) -> None:
    verl_fsdp_step(tmp_path, 10)
    s20 = verl_fsdp_step(tmp_path, 20)
    (s20 / "critic" / "optim_world_size_2_rank_1.pt").unlink()  # rank 1 killed before its optimizer save
    rec = layouts.verify_path(s20)
    assert not rec.valid and "critic" in rec.reason and "optim shards missing for ranks [1]" in rec.reason
    assert layouts.latest_valid(tmp_path).step == 10
    st = layouts.tracker_status(tmp_path)
    assert st.step == 20 and st.step_valid is False and not st.ok and st.newest_valid_step == 10


def test_fsdp_truncated_pt_zip(tmp_path: Path) -> None:
    verl_fsdp_step(tmp_path, 10)
    s20 = verl_fsdp_step(tmp_path, 20)
    truncate(s20 / "actor" / "model_world_size_2_rank_0.pt", 0.7)
    rec = layouts.verify_path(s20)
    assert not rec.valid and "model_world_size_2_rank_0.pt" in rec.reason
    assert layouts.latest_valid(tmp_path).step == 10


def test_fsdp_missing_config_and_empty_role(tmp_path: Path) -> None:
    verl_fsdp_step(tmp_path, 10)
    s20 = verl_fsdp_step(tmp_path, 20)
    (s20 / "actor" / "fsdp_config.json").unlink()
    s30 = tmp_path / "global_step_30"
    (s30 / "actor").mkdir(parents=True)  # made the directory, died before writing
    assert "fsdp_config.json missing" in layouts.verify_path(s20).reason
    assert not layouts.verify_path(s30).valid
    assert layouts.latest_valid(tmp_path).step == 10


def test_fsdp_missing_dataloader_state_when_run_writes_it(tmp_path: Path) -> None:
    verl_fsdp_step(tmp_path, 10)
    s20 = verl_fsdp_step(tmp_path, 20)
    (s20 / "data.pt").unlink()  # roles saved, trainer killed before data.pt and the tracker
    write_tracker(tmp_path, 10)
    assert "data.pt missing" in layouts.verify_path(s20).reason
    assert layouts.latest_valid(tmp_path).step == 10
    assert layouts.tracker_status(tmp_path).ok


def test_fsdp_tracker_names_deleted_step(tmp_path: Path) -> None:
    """max_ckpt_to_keep=1 plus a crash can leave the tracker pointing at a removed step."""
    verl_fsdp_step(tmp_path, 30, tracker=False)
    write_tracker(tmp_path, 20)
    st = layouts.tracker_status(tmp_path)
    assert st.step == 20 and st.step_valid is False and "gone" in st.step_reason
    assert st.newest_valid_step == 30
    assert layouts.latest_valid(tmp_path).step == 30


@pytest.mark.parametrize("content", ["", "2", "  \n", "global_step_20", "\x00\x00"])
def test_fsdp_torn_tracker_does_not_crash(tmp_path: Path, content: str) -> None:
    verl_fsdp_step(tmp_path, 10)
    verl_fsdp_step(tmp_path, 20, tracker=False)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(content)
    st = layouts.tracker_status(tmp_path)
    assert not st.ok and st.newest_valid_step == 20
    assert layouts.latest_valid(tmp_path).step == 20


def test_fsdp_async_save_never_wrote_tracker(tmp_path: Path) -> None:
    verl_fsdp_step(tmp_path, 10)
    verl_fsdp_step(tmp_path, 20, tracker=False)
    st = layouts.tracker_status(tmp_path)
    assert st.step == 10 and st.step_valid and not st.ok and "newer valid step" in st.describe()
    assert layouts.latest_valid(tmp_path).step == 20


def test_global_steps_spelling(tmp_path: Path) -> None:
    verl_fsdp_step(tmp_path, 5, dirname="global_steps_{}")
    rec = layouts.latest_valid(tmp_path)
    assert rec is not None and rec.path.name == "global_steps_5"


# ------------------------------------------------------------------ Megatron engine, layout v2

def test_megatron_v2_complete_and_manifest_missing(tmp_path: Path) -> None:
    verl_megatron_step(tmp_path, 10)
    verl_megatron_step(tmp_path, 20, manifest=False, tracker=False)  # killed before ckpt_contents.json
    recs = {r.step: r for r in layouts.scan(tmp_path)}
    assert recs[10].valid, recs[10].reason
    assert not recs[20].valid and "ckpt_contents.json missing" in recs[20].reason
    assert layouts.latest_valid(tmp_path).step == 10


def test_megatron_v2_one_role_incomplete(tmp_path: Path) -> None:
    verl_megatron_step(tmp_path, 10)
    s20 = verl_megatron_step(tmp_path, 20)
    (s20 / "critic" / "ckpt_contents.json").unlink()
    rec = layouts.verify_path(s20)
    assert not rec.valid and rec.reason.startswith("critic:")
    assert layouts.latest_valid(tmp_path).step == 10


def test_megatron_v2_truncated_distcp_and_missing_metadata(tmp_path: Path) -> None:
    verl_megatron_step(tmp_path, 10)
    s20 = verl_megatron_step(tmp_path, 20)
    s30 = verl_megatron_step(tmp_path, 30)
    truncate(largest(s20 / "actor" / "optimizer" / "dist_ckpt", "*.distcp"), 0.5)
    (s30 / "actor" / "extra" / "dist_ckpt" / ".metadata").unlink()
    r20, r30 = layouts.verify_path(s20), layouts.verify_path(s30)
    assert "optimizer" in r20.reason and "truncated" in r20.reason
    assert "rng_state" in r30.reason and ".metadata missing" in r30.reason
    assert layouts.latest_valid(tmp_path).step == 10
    assert layouts.verify_path(tmp_path / "global_step_10").valid
    # a role directory on its own
    role = layouts.verify_path(s20 / "critic")
    assert role.valid and role.role == "critic" and role.step == 20


def test_megatron_v2_manifest_path_missing_or_torn(tmp_path: Path) -> None:
    s10 = verl_megatron_step(tmp_path, 10)
    manifest = s10 / "actor" / "ckpt_contents.json"
    data = json.loads(manifest.read_text())
    data["contents"]["hf_config"] = {"path": "model/huggingface", "format": "huggingface"}
    manifest.write_text(json.dumps(data))
    assert "model/huggingface missing" in layouts.verify_path(s10).reason
    manifest.write_text(manifest.read_text()[:40])
    assert "not valid JSON" in layouts.verify_path(s10).reason


# ------------------------------------------------------------------ pre-v2

def test_legacy_tree_is_reported_with_migration_hint(tmp_path: Path) -> None:
    verl_legacy_step(tmp_path, 10)
    assert layouts.detect_layout(tmp_path) == "verl-legacy"
    (rec,) = layouts.scan(tmp_path)
    assert rec.layout == "verl-legacy" and not rec.valid
    assert "migrate_megatron_checkpoint_layout.py --checkpoint" in rec.reason
    assert layouts.latest_valid(tmp_path) is None
