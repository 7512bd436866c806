"""Issue 28, end to end: a single-file trainer (torch.save over ``out/ckpt.pt``) under ``rlsup run`` with
torchrun and the resume placeholders (no shell wrapper), killed in the middle of a save.

Without rlsup the kill leaves ``ckpt.pt`` torn and every restart dies on it; with rlsup the newest complete
version is put back, the next attempt is started by the warm launcher with ``--init_from=resume
--resume_path=<ckpt.pt>`` filled in, resumes from the last save (one save interval lost at most), and the run
ends with exit 0 and "steps lost unknown" (the file names no step rlsup can read).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.env import JOBS, clean_env
from support.incidents import incidents
from support.ports import free_ports
from support.procs import rlsup_cmd

torch = pytest.importorskip("torch")


def test_kill_mid_save_of_a_single_file_costs_one_save_interval(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    # --max-restarts 1: the one kill (attempt 1 arms no warm launcher it would never use)
    cmd = rlsup_cmd("run", "--checkpoint-dir", "out", "--metrics-port", "0", "--max-restarts", "1", "--",
                    str(Path(sys.executable).parent / "torchrun"),
                    "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                    str(JOBS / "single_file_job.py"), "out", "--iters", "30", "--save-every", "5",
                    "--init_from={resume?resume:scratch}", "{resume:--resume_path={dir}}")
    done = subprocess.run(cmd, cwd=tmp_path, env=clean_env(SFJ_KILL_IN_SAVE="0:3"), capture_output=True, text=True,
                          timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    ckpt = tmp_path / "out" / "ckpt.pt"
    argv = re.findall(r"argv: (.*)", done.stdout)
    assert argv[0] == "['out', '--iters', '30', '--save-every', '5', '--init_from=scratch']", argv
    assert argv[1] == f"['out', '--iters', '30', '--save-every', '5', '--init_from=resume', '--resume_path={ckpt}']"
    assert re.search(r"single-file checkpoint \S*ckpt.pt is torn \(.*\); put back its newest complete version", out), out
    assert "resumed from iter 10" in done.stdout  # the kill cut the save of iter 15: one interval lost
    assert "attempt 1: started by the warm launcher" in out  # torchrun stayed visible: no shell wrapper
    assert torch.load(ckpt, weights_only=True)["iter_num"] == 30
    (inc,) = incidents(tmp_path / ".rlsup")
    assert inc["reason"] == "signal" and inc["resumed_from"] == str(ckpt) and inc["resume_known"] is False
    assert not (tmp_path / "checkpoints").exists()  # only the directory the trainer uses
    shown = subprocess.run(rlsup_cmd("incidents"), cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    assert "steps lost unknown" in shown.stdout, shown.stdout + shown.stderr
