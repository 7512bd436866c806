"""The resume placeholders of the launch command (supervisor/run/launch_args.py), as users type them."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.cli.main import main
from supervisor.run.launch_args import LaunchArgError, ResumeFill, check, expand

HF = ["torchrun", "--nproc-per-node", "2", "run_clm.py", "--output_dir", "out",
      "{resume:--resume_from_checkpoint={dir}}"]
NANOGPT = ["python", "train.py", "--init_from={resume?resume:scratch}"]


def test_a_fresh_start_drops_the_argument_and_picks_the_fresh_text() -> None:
    assert expand(HF, None) == HF[:-1]
    assert expand(NANOGPT, None) == ["python", "train.py", "--init_from=scratch"]


def test_a_resume_fills_dir_and_step_and_keeps_a_path_with_spaces_whole() -> None:
    fill = ResumeFill("/runs/my run/checkpoint-8", 8)
    assert expand(HF, fill)[-1] == "--resume_from_checkpoint=/runs/my run/checkpoint-8"
    assert expand(NANOGPT, fill)[-1] == "--init_from=resume"
    assert expand(["x", "{resume:--load {dir} --step {step}}"], fill) == [
        "x", "--load", "/runs/my run/checkpoint-8", "--step", "8"]
    assert expand(["x", "--tag=s{resume?{step}:0}"], fill) == ["x", "--tag=s8"]
    assert expand(["x", "--load={resume?s3://bucket{dir}:none}"], fill) == ["x", "--load=s3://bucket/runs/my run/checkpoint-8"]
    assert expand(["x", "--load={resume?s3://bucket{dir}:none}"], None) == ["x", "--load=none"]
    assert expand(["x", "{resume:--s={step}}"], ResumeFill("/o/ckpt.pt", None)) == ["x", "--s="]


def test_the_trainers_own_braces_pass_through() -> None:
    own = ["python", "train.py", "trainer.ckpt=${oc.env:CKPT}", "x=${resume:y}", "fmt={step}", "{a,b}", "{}"]
    assert expand(own, ResumeFill("/c", 1)) == own == expand(own, None)


@pytest.mark.parametrize("arg, why", [
    ("{resume:--resume_from_checkpoint", "no closing"),  # what an unquoted space leaves behind
    ("--x={resume:a}", "must be a whole argument"),
    ("{resume?resume}", "needs a ':'"),
])
def test_a_malformed_placeholder_is_refused_naming_the_argument(arg: str, why: str) -> None:
    with pytest.raises(LaunchArgError, match=why) as info:
        check(["python", arg])
    assert "word 2" in str(info.value) and arg in str(info.value)


def test_rlsup_run_refuses_it_before_launching(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--", "python", "-c", "pass", "{resume:--resume_from_checkpoint", "{dir}}"])
    assert code == 2 and "launch command: word 4 ('{resume:--resume_from_checkpoint')" in capsys.readouterr().err
    assert not (tmp_path / ".rlsup").exists()  # nothing launched, nothing recorded


# ------------------------------------------------------------ a trainer that picks "latest" itself (end to end)


def test_who_picks_the_checkpoint() -> None:
    from supervisor.run.launch_args import has_placeholder, picks_its_own_note, trainer_picks_its_checkpoint

    assert has_placeholder(HF) and has_placeholder(NANOGPT) and not has_placeholder(["python", "x.py", "${resume:a}"])
    assert trainer_picks_its_checkpoint(["python", "x.py", "--resume", "auto"], "single-file", False)
    assert trainer_picks_its_checkpoint(["python", "x.py"], "hf", True)
    assert not trainer_picks_its_checkpoint(["python", "x.py"], "rlsup", False)  # trainer_hooks: RLSUP_RESUME_DIR
    assert not trainer_picks_its_checkpoint(["python", "x.py"], "verl", True)  # the tracker rlsup points
    assert trainer_picks_its_checkpoint(["python", "x.py"], "verl", False)
    assert not trainer_picks_its_checkpoint(NANOGPT, "single-file", False)
    assert "WARNING" not in picks_its_own_note([])
    note = picks_its_own_note([(Path("/c/step-3"), "cut"), (Path("/c/step-2"), "cut")])
    assert "/c/step-3, which is torn (cut) (and 1 more" in note and "--quarantine-invalid" in note


def test_the_launch_line_claims_nothing_where_nothing_tells_who_picks(tmp_path: Path) -> None:
    """A fresh start beside an empty directory (a trainer_hooks trainer reads RLSUP_RESUME_DIR, a plain one may
    save nothing): no note. A torn single file there, or a step of a layout rlsup cannot steer: the note."""
    import torch

    from supervisor.run.checkpoint_sight import CheckpointSight, SightSettings
    from supervisor.config import SupervisorConfig
    from supervisor.tiers.resume import ResumePoint

    out = tmp_path / "out"
    out.mkdir()
    sight = CheckpointSight(SightSettings.from_config(SupervisorConfig(checkpoint_dir=str(out)).resolved()),
                            lambda line: None)
    plain = ["python", "train.py"]
    assert sight.launch_note(plain, None) == ""
    assert sight.launch_note(plain, ResumePoint(3, out / "step_000000003", "rlsup")) == ""
    torch.save({"x": 1}, out / "ckpt.pt")
    (out / "ckpt.pt").write_bytes((out / "ckpt.pt").read_bytes()[:40])
    note = sight.launch_note(plain, None)
    assert "picks its own checkpoint" in note and f"will load {out / 'ckpt.pt'}, which is torn" in note, note
    assert sight.launch_note([*plain, "--init_from={resume?resume:scratch}"], None) == ""  # the placeholder steers
