"""The end-to-end half of test_layouts_trainers_cli.py (real processes, or waits on real time): ``rlsup checkpoints
list|latest|verify`` and restart selection on every trainer layout of issue 18."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import layouts
from supervisor.tiers.resume import choose_resume
from test_layouts_trainers_cli import ROOT, TREES

STEPS = 3


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor.cli.checkpoints", "checkpoints", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(params=sorted(TREES))
def tree(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    module, function = TREES[request.param]
    getattr(importlib.import_module(module), function)(tmp_path, STEPS)
    return request.param, tmp_path


def test_cli_and_restart_selection_agree_on_the_newest_complete_step(tree: tuple[str, Path]) -> None:
    layout, root = tree
    assert layouts.detect_layout(root) == layout
    records = layouts.scan(root)
    steps = sorted({r.step for r in records})
    newest = max(steps)
    assert [r.valid for r in records if r.step == newest] and not any(r.valid for r in records if r.step == newest)
    best = layouts.latest_valid(root)
    assert best is not None and best.step < newest and best.layout == layout

    listed = cli("list", str(root), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert {r["step"] for r in rows} == set(steps) and all(r["layout"] == layout for r in rows)

    latest = cli("latest", str(root))
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout.strip().splitlines()[-1] == str(best.path)

    assert cli("verify", str(best.path)).returncode == 0
    broken = next(r for r in records if r.step == newest)
    verify = cli("verify", str(broken.path))
    assert verify.returncode != 0 and verify.stdout + verify.stderr

    point = choose_resume(root)
    assert point is not None and (point.step, point.path, point.layout) == (best.step, best.path, layout)


