"""The resume placeholders of the launch command (supervisor/launch_args.py), as users type them."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.cli import main
from supervisor.launch_args import LaunchArgError, ResumeFill, check, expand

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
