"""HF Trainer / TRL ``checkpoint-N`` layout: a real Trainer killed before each file kind of its second save,
and source-derived FSDP and DeepSpeed steps (tests/hf_builders.py), complete, torn and missing files."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from hf_builders import bench_tree, hf_step, truncate

from supervisor import layouts


# ------------------------------------------------------------------ source-derived builders


def test_builder_plain_sharded_and_peft(tmp_path: Path) -> None:
    hf_step(tmp_path / "a", 5, sharded=True)
    hf_step(tmp_path / "a", 10, sharded=True)
    assert layouts.detect_layout(tmp_path / "a") == "hf"
    assert layouts.latest_valid(tmp_path / "a").step == 10
    (tmp_path / "a" / "checkpoint-10" / "model-00002-of-00002.safetensors").unlink()
    rec = layouts.verify_path(tmp_path / "a" / "checkpoint-10")
    assert not rec.valid and "model-00002-of-00002.safetensors missing" in rec.reason
    hf_step(tmp_path / "p", 5, peft=True)
    p10 = hf_step(tmp_path / "p", 10, peft=True)
    assert layouts.verify_path(p10).valid
    truncate(p10 / "adapter_model.safetensors", 0.5)
    assert "adapter_model.safetensors" in layouts.verify_path(p10).reason
    assert layouts.latest_valid(tmp_path / "p").step == 5


def test_builder_multi_rank_rng(tmp_path: Path) -> None:
    hf_step(tmp_path, 5, ranks=4)
    s10 = hf_step(tmp_path, 10, ranks=4)
    (s10 / "rng_state_3.pth").unlink()  # no barrier before rank 0's trainer_state.json: rank 3 was late
    rec = layouts.verify_path(s10)
    assert not rec.valid and "rng_state" in rec.reason
    (s10 / "rng_state_1.pth").unlink()
    assert "ranks [1]" in layouts.verify_path(s10).reason
    assert layouts.latest_valid(tmp_path).step == 5


def test_builder_fsdp_sharded(tmp_path: Path) -> None:
    hf_step(tmp_path, 5, fsdp=True)
    s10 = hf_step(tmp_path, 10, fsdp=True)
    assert layouts.verify_path(s10).valid
    (s10 / "optimizer_0" / ".metadata").unlink()  # DCP writes .metadata last
    rec = layouts.verify_path(s10)
    assert not rec.valid and "optimizer_0" in rec.reason and ".metadata" in rec.reason
    s15 = hf_step(tmp_path, 15, fsdp=True)
    shard = next((s15 / "pytorch_model_fsdp_0").glob("*.distcp"))
    truncate(shard, 0.5)
    assert "pytorch_model_fsdp_0" in layouts.verify_path(s15).reason
    s20 = hf_step(tmp_path, 20, fsdp=True)
    shutil.rmtree(s20 / "optimizer_0")
    assert "optimizer_0/ missing" in layouts.verify_path(s20).reason
    assert layouts.latest_valid(tmp_path).step == 5


def test_builder_deepspeed(tmp_path: Path) -> None:
    hf_step(tmp_path, 5, deepspeed=2)
    s10 = hf_step(tmp_path, 10, deepspeed=2)
    assert layouts.verify_path(s10).valid
    (s10 / "latest").write_text("global_step9")
    assert "global_step9" in layouts.verify_path(s10).reason
    (s10 / "latest").write_text("global_step10")
    (s10 / "global_step10" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert "ranks [0]" in layouts.verify_path(s10).reason
    s15 = hf_step(tmp_path, 15, deepspeed=2)
    (s15 / "latest").unlink()  # killed inside save_checkpoint, before rank 0 wrote latest
    assert "latest missing" in layouts.verify_path(s15).reason
    s20 = hf_step(tmp_path, 20, deepspeed=2)
    truncate(s20 / "global_step20" / "mp_rank_00_model_states.pt", 0.5)
    assert "mp_rank_00_model_states.pt" in layouts.verify_path(s20).reason
    s25 = hf_step(tmp_path, 25, deepspeed=2)
    (s25 / "global_step25" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()  # the last rank was late
    assert "1 optim_states file(s), the run's previous step has 2" in layouts.verify_path(s25).reason
    assert layouts.latest_valid(tmp_path).step == 5


def test_rewrite_of_an_existing_step_is_noted(tmp_path: Path) -> None:
    """A run resumed from step 5 saves step 10 again into the old checkpoint-10 and is killed before its
    trainer_state.json: the old one still parses over a new model and an old optimizer. Indistinguishable from
    a copy that lost its mtimes, so it is a note on a valid step, not a rejection (docs/layouts.md, traps)."""
    hf_step(tmp_path, 5)
    s10 = hf_step(tmp_path, 10)
    old = time.time() - 60
    for p in s10.iterdir():
        os.utime(p, (old, old))
    assert not layouts.verify_path(s10).notes
    (s10 / "model.safetensors").write_bytes((s10 / "model.safetensors").read_bytes())  # rewritten just now
    rec = layouts.verify_path(s10)
    assert rec.valid and any("model.safetensors is newer than trainer_state.json" in n for n in rec.notes)


@pytest.mark.parametrize("content", ["", "{", "[]", '{"global_step": "x"}', "\x00\x00"])
def test_torn_trainer_state_never_raises(tmp_path: Path, content: str) -> None:
    hf_step(tmp_path, 5)
    s10 = hf_step(tmp_path, 10)
    (s10 / "trainer_state.json").write_text(content)
    assert not layouts.verify_path(s10).valid
    assert layouts.latest_valid(tmp_path).step == 5


def test_bench_tree(tmp_path: Path) -> None:
    bench_tree(tmp_path, 6)
    recs = layouts.scan(tmp_path)
    assert len(recs) == 6 and [r.valid for r in recs] == [True] * 5 + [False]
    assert layouts.latest_valid(tmp_path).step == recs[-2].step
    state = json.loads((recs[-2].path / "trainer_state.json").read_text())
    assert state["global_step"] == recs[-2].step
