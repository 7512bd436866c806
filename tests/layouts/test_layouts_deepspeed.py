"""DeepSpeed ``save_checkpoint`` trees (and OpenRLHF's ``_actor``/``_critic`` form), written by the real
deepspeed on CPU and SIGKILLed between its files: rlsup picks a complete tag, DeepSpeed's ``latest``
sometimes names a broken one, and ``repair_tracker`` points ``latest`` back at the chosen tag.

The real runs (one process: ZeRO-1 saves of global_step1 and global_step2; a 2-rank torchrun whose
rank 1 dies after rank 0 rewrote ``latest``) run once per module, two at a time.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import pytest
from deepspeed_builders import (bench_tree, synthetic_tag,
                                truncate_half)

from supervisor import layouts
from supervisor.layouts import deepspeed as dsl

# the real runs take ~45 s on an idle 2-core machine; a busy one stretches the module fixture's setup
pytestmark = pytest.mark.timeout(600)


# ------------------------------------------------------------------ the real writer


# ------------------------------------------------------------------ OpenRLHF: _actor/ and _critic/


# ------------------------------------------------------------------ built from the 0.19.8 source


def test_zero3_needs_every_dp_rank_model_states(tmp_path: Path) -> None:
    synthetic_tag(tmp_path, 1, dp=2, stage=3)
    tag = synthetic_tag(tmp_path, 2, dp=2, stage=3)
    assert layouts.latest_valid(tmp_path).step == 2
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    bad = layouts.verify_path(tag)
    assert not bad.valid and "zero_pp_rank_1_mp_rank_00_model_states.pt missing" in bad.reason
    assert layouts.latest_valid(tmp_path).step == 1


def test_model_parallel_and_bf16_shards(tmp_path: Path) -> None:
    tag = synthetic_tag(tmp_path, 3, dp=2, mp=2, stage=0, bf16=True)
    assert layouts.verify_path(tag).valid
    (tag / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    assert "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt missing" in layouts.verify_path(tag).reason
    tag = synthetic_tag(tmp_path, 4, dp=1, mp=2, stage=1)
    (tag / "mp_rank_01_model_states.pt").unlink()
    assert "mp_rank_01_model_states.pt missing" in layouts.verify_path(tag).reason


def test_pipeline_layer_files(tmp_path: Path) -> None:
    synthetic_tag(tmp_path, 1, dp=1, layers=3)
    tag = synthetic_tag(tmp_path, 2, dp=1, layers=3)
    assert layouts.latest_valid(tmp_path).step == 2
    (tag / "layer_02-model_states.pt").unlink()  # killed before the last layer file
    assert "layer_02-model_states.pt missing" in layouts.verify_path(tag).reason
    synthetic_tag(tmp_path, 2, dp=1, layers=3)
    truncate_half(tag / "layer_01-model_states.pt")
    assert "layer_01-model_states.pt" in layouts.verify_path(tag).reason
    assert layouts.latest_valid(tmp_path).step == 1


def test_torn_and_foreign_files_never_raise(tmp_path: Path) -> None:
    synthetic_tag(tmp_path, 1, dp=1)
    tag = synthetic_tag(tmp_path, 2, dp=1)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert "is empty" in layouts.verify_path(tag).reason
    (tmp_path / "latest").write_text("../../etc\n")
    assert "not a tag name" in layouts.tracker_status(tmp_path).error
    (tmp_path / "global_step3").mkdir()  # killed right after mkdir
    assert "no mp_rank_XX_model_states.pt" in layouts.verify_path(tmp_path / "global_step3").reason
    assert layouts.latest_valid(tmp_path).step == 1


class _Boom:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch pwned",))


def test_restricted_unpickler_refuses_code(tmp_path: Path) -> None:
    tag = synthetic_tag(tmp_path, 1, dp=1)
    path = tag / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"dp_world_size": 1, "x": _Boom()}))
    meta, err = dsl.read_meta(path)
    assert meta is None and "refusing to unpickle posix.system" in err
    rec = layouts.verify_path(tag)  # falls back to the files present, says so
    assert rec.valid and any("guessed" in n for n in rec.notes)
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def test_names_other_layouts_use_are_not_deepspeed(tmp_path: Path) -> None:
    (tmp_path / "global_step_10" / "actor").mkdir(parents=True)  # verl: underscore
    assert not dsl.looks_like(tmp_path) and not dsl.owns(tmp_path / "global_step_10")


def test_custom_tag_named_by_latest(tmp_path: Path) -> None:
    tag = synthetic_tag(tmp_path, 7, dp=1)
    tag.rename(tmp_path / "epoch1-step70")
    (tmp_path / "latest").write_text("epoch1-step70")
    assert [(s, p.name) for s, p in dsl.list_steps(tmp_path)] == [(70, "epoch1-step70")]
    assert layouts.latest_valid(tmp_path).valid and layouts.tracker_status(tmp_path).ok


def test_bench_tree(tmp_path: Path) -> None:
    bench_tree(tmp_path, 5)
    assert layouts.latest_valid(tmp_path).step == 4
    st = layouts.tracker_status(tmp_path)
    assert (st.step, st.step_valid, st.newest_valid_step) == (5, False, 4)


