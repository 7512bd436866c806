"""``rlsup checkpoints list|latest|verify`` through ``python -m supervisor.cli.checkpoints`` and the real
CLI: layouts' steps and single-file checkpoints (nanoGPT's ``out/ckpt.pt``, litgpt's ``step-*/lit_model.pth``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rlsup_format.names import parse_reserved

from layout_builders import verl_fsdp_step, write_tracker

from supervisor.cli import checkpoints as checkpoints_cli

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli.checkpoints", "checkpoints", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_latest_reports_lying_tracker_and_repairs_it(tmp_path: Path) -> None:
    verl_fsdp_step(tmp_path, 10)
    s20 = verl_fsdp_step(tmp_path, 20)
    (s20 / "actor" / "model_world_size_2_rank_1.pt").unlink()
    p = run("latest", str(tmp_path))
    assert p.returncode == 0
    assert p.stdout.strip().splitlines()[-1] == str(tmp_path / "global_step_10")
    assert "names step 20" in p.stderr
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "20"  # untouched without the flag

    p = run("latest", str(tmp_path), "--repair-tracker")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert (tmp_path / "latest_checkpointed_iteration.txt.rlsup-prev").read_text() == "20"
    assert "rewrote" in p.stderr
    assert not [x for x in tmp_path.iterdir() if x.name.endswith(".tmp") or parse_reserved(x.name)]
    p = run("latest", str(tmp_path))
    assert "tracker" not in p.stderr


def test_latest_exit_1_when_nothing_valid(tmp_path: Path) -> None:
    s = verl_fsdp_step(tmp_path, 10)
    (s / "critic" / "fsdp_config.json").unlink()
    write_tracker(tmp_path, "")
    assert checkpoints_cli.main(["checkpoints", "latest", str(tmp_path)]) == 1
    assert checkpoints_cli.main(["checkpoints", "latest", str(tmp_path / "nope")]) == 1


def test_list_and_json(tmp_path: Path, capsys) -> None:
    verl_fsdp_step(tmp_path, 10)
    s20 = verl_fsdp_step(tmp_path, 20)
    (s20 / "data.pt").unlink()
    assert checkpoints_cli.main(["checkpoints", "list", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "valid" in lines[0] and "INVALID: data.pt missing" in lines[1]
    assert checkpoints_cli.main(["checkpoints", "list", str(tmp_path), "--json", "--layout", "verl"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(d["step"], d["valid"]) for d in data] == [(10, True), (20, False)]
    assert data[0]["size_bytes"] > 0 and data[0]["layout"] == "verl"


def test_verify_exit_codes(tmp_path: Path) -> None:
    good = verl_fsdp_step(tmp_path, 10)
    bad = verl_fsdp_step(tmp_path, 20)
    (bad / "actor" / "extra_state_world_size_2_rank_0.pt").write_bytes(b"PK\x03\x04torn")
    assert run("verify", str(good)).returncode == 0
    p = run("verify", str(bad))
    assert p.returncode == 1 and "extra_state_world_size_2_rank_0.pt" in p.stdout


def test_register_adds_subcommand() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    checkpoints_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["checkpoints", "latest", "/x", "--layout", "megatron"])
    assert args.func is checkpoints_cli.cmd_latest and args.layout == "megatron"


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The real ``rlsup`` entry point (``python -m supervisor.cli.main``), as a user runs it."""
    return subprocess.run([sys.executable, "-m", "supervisor.cli.main", "checkpoints", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _torch_save(path: Path, value: float, mtime: int) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": torch.full((64,), value), "iter_num": int(value)}, path)
    os.utime(path, (mtime, mtime))  # saves in order, whatever the filesystem's timestamp granularity


def _tear(path: Path, mtime: int) -> None:
    """A save killed halfway: the file cut to half its length, written last."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    os.utime(path, (mtime, mtime))


def test_nanogpt_out_dir_lists_and_names_the_complete_file(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _torch_save(out / "ckpt.pt", 1.0, 1_000)
    (out / "train.bin").write_bytes(b"\0" * 64)  # nanoGPT's data beside it is never a checkpoint
    p = _cli("latest", str(out))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == str(out / "ckpt.pt")
    p = _cli("list", str(out), "--json")
    assert p.returncode == 0, p.stderr
    assert [(d["path"], d["layout"], d["valid"]) for d in json.loads(p.stdout)] == [
        (str(out / "ckpt.pt"), "single-file", True)]

    _tear(out / "ckpt.pt", 2_000)  # the only file torn: nothing to name, and it is said
    p = _cli("latest", str(out))
    assert p.returncode == 1 and p.stdout == "", p.stdout
    assert f"newer but torn: {out / 'ckpt.pt'}" in p.stderr and f"no valid checkpoint in {out}" in p.stderr


def test_litgpt_step_tree_names_the_newest_complete_file_not_the_torn_newest(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for i, step in enumerate((50, 60, 70, 80)):
        _torch_save(out / f"step-{step:08d}" / "lit_model.pth", float(step), 1_000 + i)
        (out / f"step-{step:08d}" / "hyperparameters.yaml").write_text("lr: 0.1\n")
    _tear(out / "step-00000080" / "lit_model.pth", 2_000)
    newest_complete = out / "step-00000070" / "lit_model.pth"
    for extra in ([], ["--layout", "single-file"], ["--layout", "single-file", "--file", "step-*/lit_model.pth"]):
        p = _cli("latest", str(out), *extra)
        assert p.returncode == 0, (extra, p.stderr)
        assert p.stdout.strip().splitlines()[-1] == str(newest_complete), extra
        assert f"newer but torn: {out / 'step-00000080' / 'lit_model.pth'}" in p.stderr
    p = _cli("list", str(out), "--json")
    assert p.returncode == 0, p.stderr
    assert [(d["step"], d["valid"]) for d in json.loads(p.stdout)] == [(50, True), (60, True), (70, True), (80, False)]
    p = _cli("list", str(out))
    assert "INVALID" in p.stdout.splitlines()[-1] and "step-00000080" in p.stdout.splitlines()[-1]
    # --file beside another layout is refused, not ignored
    p = _cli("latest", str(out), "--layout", "verl", "--file", "step-*/lit_model.pth")
    assert p.returncode == 2 and "--file names single-file checkpoints" in p.stderr


def test_checkpoints_latest_is_what_rlsup_run_resumes_from(tmp_path: Path) -> None:
    """One code for both: the run's resume choice over the same litgpt tree names the same file."""
    from supervisor.run.checkpoint_sight import CheckpointSight, SightSettings
    from supervisor.config import SupervisorConfig

    out = tmp_path / "out"
    for i, step in enumerate((10, 20)):
        _torch_save(out / f"step-{step:08d}" / "lit_model.pth", float(step), 1_000 + i)
    _tear(out / "step-00000020" / "lit_model.pth", 2_000)
    cfg = SupervisorConfig(checkpoint_dir=str(out)).resolved()
    point = CheckpointSight(SightSettings.from_config(cfg), lambda line: None).resume_fallback()
    assert point is not None and point.path == out / "step-00000010" / "lit_model.pth" and point.step is None
    assert _cli("latest", str(out)).stdout.strip().splitlines()[-1] == str(point.path)
