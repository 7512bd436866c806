"""The end-to-end half of test_launch_args.py (real processes, or waits on real time): the resume placeholders of
the launch command (supervisor/run/launch_args.py), as users type them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path




# ------------------------------------------------------------ a trainer that picks "latest" itself (end to end)

def _litgpt_tree(out: Path) -> None:
    """Steps 10 and 20 complete, step 30 torn (a save killed halfway), as step_dir_job.py writes them."""
    import os

    import torch

    for i, it in enumerate((10, 20, 30)):
        path = out / f"step-{it:08d}" / "lit_model.pth"
        path.parent.mkdir(parents=True)
        torch.save({"model": torch.full((8,), float(it)), "iter_num": it}, path)
        os.utime(path, (1_000 + i, 1_000 + i))
    torn = out / "step-00000030" / "lit_model.pth"
    data = torn.read_bytes()
    torn.write_bytes(data[: len(data) // 2])


def _run_step_dir_job(tmp_path: Path, *rlsup_args: str, resume: str = "auto") -> "subprocess.CompletedProcess[str]":
    from support.env import JOBS
    from support.procs import run_rlsup

    return run_rlsup(["run", "--checkpoint-dir", "out", "--metrics-port", "0", "--backoff-initial", "0.05",
                      "--backoff-max", "0.1", *rlsup_args, "--", sys.executable, str(JOBS / "step_dir_job.py"), "out",
                      "--iters", "40", "--save-every", "10", f"--resume={resume}"], tmp_path, timeout=180)


def _launch_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.search(r"attempt \d+: launching ", line)]


def test_torn_newest_step_under_a_trainer_that_picks_it_is_named_with_both_remedies(tmp_path: Path) -> None:
    _litgpt_tree(tmp_path / "out")
    r = _run_step_dir_job(tmp_path, "--max-restarts", "0")
    assert r.returncode != 0, r.stderr[-3000:]  # the trainer loaded the torn step, as litgpt did
    (line,) = _launch_lines(r.stderr)
    chosen, torn = tmp_path / "out" / "step-00000020" / "lit_model.pth", tmp_path / "out" / "step-00000030" / "lit_model.pth"
    assert f"from {chosen}; the trainer picks its own checkpoint" in line, line  # rlsup's choice, and who picks
    assert f"WARNING: if it loads its newest, it will load {torn}, which is torn (" in line, line
    assert "--quarantine-invalid" in line and "{resume:--resume {dir}}" in line, line  # the two remedies


def test_with_quarantine_invalid_the_trainer_picking_latest_finishes(tmp_path: Path) -> None:
    _litgpt_tree(tmp_path / "out")
    r = _run_step_dir_job(tmp_path, "--max-restarts", "0", "--quarantine-invalid")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from out/step-00000020/lit_model.pth at iter 20" in r.stdout, r.stdout[-2000:]
    (line,) = _launch_lines(r.stderr)
    assert "the trainer picks its own checkpoint" in line and "WARNING" not in line, line  # nothing torn is left
    assert [p.name for p in (tmp_path / "out" / "step-00000030").iterdir() if ".rlsup-invalid-" in p.name]


def test_with_the_placeholder_the_trainer_loads_rlsups_choice_and_finishes(tmp_path: Path) -> None:
    _litgpt_tree(tmp_path / "out")
    r = _run_step_dir_job(tmp_path, "--max-restarts", "0", resume="{resume?{dir}:auto}")
    assert r.returncode == 0, r.stderr[-3000:]
    chosen = tmp_path / "out" / "step-00000020" / "lit_model.pth"
    assert f"resumed from {chosen} at iter 20" in r.stdout, r.stdout[-2000:]
    (line,) = _launch_lines(r.stderr)
    assert "picks its own" not in line and f"--resume={chosen}" in line, line  # rlsup steers: nothing to warn of


