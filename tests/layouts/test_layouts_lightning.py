"""Lightning checkpoints: the real ModelCheckpoint writer SIGKILLed before each file event of a save
(tests/kill_matrix.py), half-written variants, and source-derived FSDP / DeepSpeed directories.

Every kill must leave rlsup's ``latest_valid`` on a complete step (step B only when B's named file is
complete, else step A); for some kill points Lightning's own ``ckpt_path="last"`` would resume from
nothing or from a torn ``last.ckpt`` (asserted: the failure rlsup protects against).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

import lightning_builders as lb
from supervisor import layouts
from supervisor.layouts import lightning as lt


def test_last_symlink_dangling_and_copy(tmp_path: Path) -> None:
    """A last.ckpt symlink to a listed file is the same checkpoint (listed once); a dangling one is
    invalid with a reason; a last.ckpt copy is its own entry and loses a tie to the named file."""
    lb.ckpt_file(tmp_path / "epoch=0-step=2.ckpt", 2)
    os.symlink("epoch=0-step=2.ckpt", tmp_path / "last.ckpt")
    assert [p.name for _, p in lt.list_steps(tmp_path)] == ["epoch=0-step=2.ckpt"]
    assert layouts.verify_path(tmp_path / "last.ckpt").valid
    os.remove(tmp_path / "last.ckpt")
    os.symlink("epoch=0-step=9.ckpt", tmp_path / "last.ckpt")
    # (verify_path answers "does not exist" for a dangling link before asking the layout)
    (rec,) = [r for r in layouts.scan(tmp_path) if r.path.name == "last.ckpt"]
    assert not rec.valid and "dangling" in rec.reason and rec.step == 9
    assert layouts.latest_valid(tmp_path).step == 2
    os.remove(tmp_path / "last.ckpt")
    lb.ckpt_file(tmp_path / "last.ckpt", 2)
    assert [p.name for _, p in lt.list_steps(tmp_path)] == ["last.ckpt", "epoch=0-step=2.ckpt"]
    assert layouts.latest_valid(tmp_path).path.name == "epoch=0-step=2.ckpt"
    lb.ckpt_file(tmp_path / "last.ckpt", 7)  # a copy newer than every named file wins on its own step
    assert layouts.latest_valid(tmp_path).path.name == "last.ckpt"


def test_step_from_pickle_and_torn_files(tmp_path: Path) -> None:
    """Without step=S in the name the step is the pickled global_step; torn/empty/foreign files never raise."""
    lb.ckpt_file(tmp_path / "custom-name.ckpt", 11)
    assert lt.list_steps(tmp_path)[0][0] == 11 and layouts.latest_valid(tmp_path).step == 11
    (tmp_path / "empty-step=20.ckpt").write_bytes(b"")
    (tmp_path / "foreign-step=21.ckpt").write_text("hello")
    shutil.copyfile(tmp_path / "custom-name.ckpt", tmp_path / "torn-step=22.ckpt")
    lb.truncate_half(tmp_path / "torn-step=22.ckpt")
    reasons = {r.path.name: r.reason for r in layouts.scan(tmp_path) if not r.valid}
    assert "empty" in reasons["empty-step=20.ckpt"] and "not a zip" in reasons["foreign-step=21.ckpt"]
    assert "torn-step=22.ckpt" in reasons["torn-step=22.ckpt"]
    assert layouts.latest_valid(tmp_path).step == 11
    weights_only = {"global_step": 30, "epoch": 0}  # no state_dict: not resumable by Lightning
    torch.save(weights_only, tmp_path / "x-step=30.ckpt")
    assert "no state_dict" in layouts.verify_path(tmp_path / "x-step=30.ckpt").reason
    state = torch.load(lb.ckpt_template(), map_location="cpu", weights_only=False)
    for key in ("optimizer_states", "lr_schedulers"):  # what save_weights_only=True leaves out
        state.pop(key, None)
    torch.save(state, tmp_path / "w-step=31.ckpt")
    assert "weights-only" in layouts.verify_path(tmp_path / "w-step=31.ckpt").reason
    assert layouts.latest_valid(tmp_path).step == 11


def test_pickle_globals_are_never_imported(tmp_path: Path) -> None:
    """A checkpoint naming an arbitrary callable (os.system) parses to inert stubs: nothing runs."""
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    state = torch.load(lb.ckpt_template(), map_location="cpu", weights_only=False)
    state["hyper_parameters"] = {"x": Evil()}
    torch.save(state, tmp_path / "epoch=0-step=3.ckpt")
    assert layouts.latest_valid(tmp_path).step == 3
    assert not (tmp_path / "pwned").exists()


def test_versioned_roots(tmp_path: Path) -> None:
    """Lightning's default dirpath opens lightning_logs/version_N/checkpoints per restart: the run root
    is read across versions."""
    lb.ckpt_file(tmp_path / "lightning_logs/version_0/checkpoints/epoch=0-step=4.ckpt", 4)
    lb.ckpt_file(tmp_path / "lightning_logs/version_1/checkpoints/epoch=0-step=8.ckpt", 8)
    assert layouts.detect_layout(tmp_path) == "lightning"
    assert layouts.latest_valid(tmp_path).step == 8


def test_fsdp_sharded_directories(tmp_path: Path) -> None:
    """Sharded FSDP: valid only with the DCP complete and meta.pt (written last) intact."""
    good = lb.fsdp_sharded_dir(tmp_path / "epoch=0-step=2.ckpt", 2)
    assert layouts.verify_path(good).valid and layouts.verify_path(good).step == 2
    cases = {
        "no-meta": lambda d: os.remove(d / "meta.pt"),
        "torn-meta": lambda d: lb.truncate_half(d / "meta.pt"),
        "no-metadata": lambda d: os.remove(d / ".metadata"),
        "torn-shard": lambda d: lb.truncate_half(next(d.glob("*.distcp"))),
    }
    for i, (name, breaker) in enumerate(cases.items()):
        d = lb.fsdp_sharded_dir(tmp_path / f"{name}-step={10 + i}.ckpt", 10 + i)
        breaker(d)
        rec = layouts.verify_path(d)
        assert not rec.valid and rec.reason, (name, rec)
    assert layouts.latest_valid(tmp_path).step == 2


def test_deepspeed_directories(tmp_path: Path) -> None:
    """DeepSpeed: valid only with ``latest`` (written last) naming a tag whose files are intact and
    whose optimizer shards cover dp_world_size."""
    good = lb.deepspeed_dir(tmp_path / "epoch=0-step=2.ckpt", 2)
    assert layouts.verify_path(good).valid and layouts.verify_path(good).step == 2
    tag = "checkpoint"
    cases = {
        "no-latest": lambda d: os.remove(d / "latest"),
        "empty-latest": lambda d: (d / "latest").write_text(""),
        "torn-model": lambda d: lb.truncate_half(d / tag / "mp_rank_00_model_states.pt"),
        "missing-rank": lambda d: os.remove(d / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        "torn-optim": lambda d: lb.truncate_half(d / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    }
    for i, (name, breaker) in enumerate(cases.items()):
        d = lb.deepspeed_dir(tmp_path / f"{name}-step={10 + i}.ckpt", 10 + i)
        breaker(d)
        rec = layouts.verify_path(d)
        assert not rec.valid and rec.reason, (name, rec)
    assert layouts.latest_valid(tmp_path).step == 2


def test_bench_tree(tmp_path: Path) -> None:
    lb.bench_tree(tmp_path, 20)
    record = layouts.latest_valid(tmp_path)
    assert record is not None and record.step == 19
