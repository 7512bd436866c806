"""Reading a DCP checkpoint imports no torch (supervisor.layouts.inert_pickle): ``rlsup checkpoints list`` on a
torchtitan/NeMo/DCP directory costs a fresh interpreter, not a torch import (1-2 s of CPU). A process of its own:
the test's own worker has torch imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from layout_builders import dcp_save

from support.env import clean_env


def test_listing_dcp_checkpoints_imports_no_torch(tmp_path: Path) -> None:
    for step in (1, 2):
        dcp_save(tmp_path / "ckpt" / f"step_{step}", seed=step)
    probe = ("import runpy, sys; sys.argv = ['rlsup', 'checkpoints', 'list', sys.argv[1], '--json']\n"
             "try:\n    runpy.run_module('supervisor.cli.main', run_name='__main__')\n"
             "finally:\n    print('TORCH', 'torch' in sys.modules, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "ckpt")], capture_output=True, text=True,
                       env=clean_env(), timeout=60)
    assert "TORCH False" in r.stderr, r.stderr[-2000:]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    listed = json.loads(r.stdout)
    assert [(c["step"], c["layout"], c["valid"]) for c in listed] == [(1, "dcp", True), (2, "dcp", True)], listed
