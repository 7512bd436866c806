"""The end-to-end half of test_step_writer.py (real processes, or waits on real time): trainer_hooks.step_writer on
plain data, in process: the one protocol that writes a rank's part."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


from rlsup_format.manifest import verify_step_dir
from rlsup_format.names import Kind, parse_reserved, reserved_name, staging_label, step_dir_name
from trainer_hooks.backends.torch_backend import TorchBackend
from trainer_hooks.step_writer import (
    StepTarget,
    write_step,
)
from test_step_writer import _who, _payload






# ------------------------------------------------------------------------------ a step verifies


# ------------------------------------------------------------------------ the manifest is last


# ----------------------------------------------------------------- a valid part is not rewritten


# -------------------------------------------------------------------------------- retention


# ------------------------------------------------------------------------------ another job


# ------------------------------------------------------------------------- killed saves' leftovers


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_a_dead_writer_go_a_live_writers_stay(tmp_path: Path) -> None:
    step_dir = tmp_path / step_dir_name(1)
    step_dir.mkdir()
    mine = reserved_name(Kind.STAGING, staging_label(0))  # this host, this pid: re-shaped below
    res = parse_reserved(mine)
    assert res is not None
    dead = step_dir / f".staging-{staging_label(0)}-{res.host}-{_dead_pid()}-{res.token}"
    live = step_dir / f".staging-{staging_label(1)}-{res.host}-{os.getppid()}-{res.token}"
    dead_tmp = step_dir / f".tmp-manifest.rank_00000.json-{res.host}-{_dead_pid()}-{res.token}"
    for d in (dead, live):
        d.mkdir()
        (d / "half.pt").write_bytes(b"partial")
    dead_tmp.write_text("{")
    write_step(StepTarget(tmp_path), 1, _payload(), _who(), TorchBackend())
    names = set(os.listdir(step_dir))
    assert dead.name not in names and dead_tmp.name not in names
    assert live.name in names  # its writer (our parent) is alive: never touched
    assert verify_step_dir(step_dir).valid
