"""The end-to-end half of test_layouts_hf.py (real processes, or waits on real time): hF Trainer / TRL
``checkpoint-N`` layout: a real Trainer killed before each file kind of its second save, and source-derived FSDP
and DeepSpeed steps (tests/hf_builders.py), complete, torn and missing files."""

from __future__ import annotations

import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.env import JOBS, ROOT
from hf_builders import truncate

import kill_matrix
from supervisor import layouts


def get_last_checkpoint(folder: str) -> str | None:
    """transformers' own pick of the checkpoint to resume; imported when a test asks (at collection it cost every
    worker ~3 s, e2e or not)."""
    trainer_utils = pytest.importorskip("transformers.trainer_utils")
    return trainer_utils.get_last_checkpoint(folder)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSUP_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _writer(root: Path) -> list[str]:
    return [sys.executable, str(JOBS / "hf_train_job.py"), str(root), "--max-steps", "2", "--save-steps", "1"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[kill_matrix.FileEvent]]:
    root = tmp_path_factory.mktemp("hf-record") / "out"
    root.mkdir()
    events, _ = kill_matrix.record_events(_writer(root), root, env=_env(), timeout=300)
    return root, events


KILL_KINDS = ("mkdir", "config.json", "model.safetensors", "optimizer.pt", "trainer_state.json")


def _save_b_kill_points(events: list[kill_matrix.FileEvent]) -> list[kill_matrix.FileEvent]:
    """The first event of step 2's save for each distinct kind of file: the directory, a JSON file, the
    safetensors weights, a torch.save zip, and the commit point. The half-written variants then cut the file
    written just before each (generation_config.json, training_args.bin, rng_state.pth): every file kind of the
    save is covered by a kill before it or inside it, at 5 runs of a ~10 s writer."""
    out: dict[str, kill_matrix.FileEvent] = {}
    for e in events:
        kind = "mkdir" if e.event == "os.mkdir" else Path(e.path).name
        if "checkpoint-2" in e.path and kind in KILL_KINDS and kind not in out:
            out[kind] = e
    return list(out.values())


def _kill_and_check(point: kill_matrix.FileEvent, events: list[kill_matrix.FileEvent], root: Path) -> bool:
    """Kill before ``point``; rlsup must pick step 1. True when transformers would pick the broken step 2."""
    root.mkdir()
    kill_matrix.run_killed_at(_writer(root), root, point.index, env=_env(), timeout=300)
    best = layouts.latest_valid(root)
    assert best is not None and best.step == 1, (point.describe(), best)
    rec2 = layouts.verify_path(root / "checkpoint-2") if (root / "checkpoint-2").exists() else None
    assert rec2 is None or not rec2.valid, point.describe()
    picks_broken = get_last_checkpoint(str(root)) == str(root / "checkpoint-2")
    _half_written_variant(root, events, point)
    return picks_broken


def test_kill_before_each_file_of_the_second_save(recorded, tmp_path: Path) -> None:
    _, events = recorded
    points = _save_b_kill_points(events)
    assert [("mkdir" if p.event == "os.mkdir" else Path(p.path).name) for p in points] == list(KILL_KINDS)
    with ThreadPoolExecutor(2) as pool:  # two writers at a time: each is mostly interpreter start-up
        picks = list(pool.map(lambda p: _kill_and_check(p, events, tmp_path / f"k{p.index}"), points))
    # transformers' resume_from_checkpoint=True takes the highest checkpoint-N, torn or not (#35782, #35525)
    assert any(picks), "get_last_checkpoint never picked the broken step"
    assert picks[-1], "killed just before trainer_state.json: get_last_checkpoint picks the broken step"


def _half_written_variant(root: Path, events: list[kill_matrix.FileEvent], point: kill_matrix.FileEvent) -> None:
    """A kill inside a write: the file event k-1 created, cut to half; still never the chosen step."""
    prev = next((e for e in events if e.index == point.index - 1), None)
    if prev is None or prev.event != "open" or "checkpoint-2" not in prev.path:
        return
    target = root / "checkpoint-2" / Path(prev.path).name
    if not target.exists() or target.stat().st_size < 2:
        return
    truncate(target, 0.5)
    rec = layouts.verify_path(root / "checkpoint-2")
    assert not rec.valid, (point.describe(), rec)
    assert layouts.latest_valid(root).step == 1


def test_half_written_trainer_state_and_torn_files(recorded, tmp_path: Path) -> None:
    src, _ = recorded
    for name, expect in (("trainer_state.json", "trainer_state.json"), ("optimizer.pt", "optimizer.pt"),
                         ("model.safetensors", "model.safetensors"), ("rng_state.pth", "rng_state.pth")):
        root = tmp_path / name
        shutil.copytree(src, root)
        truncate(root / "checkpoint-2" / name, 0.5)
        rec = layouts.verify_path(root / "checkpoint-2")
        assert not rec.valid and expect in rec.reason, rec
        assert layouts.latest_valid(root).step == 1
        assert get_last_checkpoint(str(root)).endswith("checkpoint-2")


def test_missing_optimizer_is_invalid_when_the_run_saves_it(recorded, tmp_path: Path) -> None:
    """Trainer's resume silently skips a missing optimizer.pt/scheduler.pt/rng_state.pth; rlsup does not."""
    root = tmp_path / "r"
    shutil.copytree(recorded[0], root)
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (root / "checkpoint-2" / name).rename(root / name)
        rec = layouts.verify_path(root / "checkpoint-2")
        assert not rec.valid and name in rec.reason, rec
        (root / name).rename(root / "checkpoint-2" / name)
    assert layouts.verify_path(root / "checkpoint-2").valid


def test_trainer_state_step_mismatch(recorded, tmp_path: Path) -> None:
    root = tmp_path / "r"
    shutil.copytree(recorded[0], root)
    shutil.copytree(root / "checkpoint-1", root / "checkpoint-3")  # a copy under the wrong name
    rec = layouts.verify_path(root / "checkpoint-3")
    assert not rec.valid and "global_step 1" in rec.reason
    assert layouts.latest_valid(root).step == 2


# ------------------------------------------------------------------ source-derived builders


