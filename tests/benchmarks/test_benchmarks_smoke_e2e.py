"""benchmarks/run.py runs and prints its table: a cheap subset only, and no timed assertions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.env import ROOT, clean_env


def test_run_quick_selection_and_heartbeat_prints_table(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--only", "selection,heartbeat",
         "--layouts", "rlsup,dcp", "--dir", str(tmp_path)],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("name") and "rlsup median" in line)
    assert all(col in lines[header] for col in ("baseline median", "ratio", "unit"))
    rows = [line.split("|") for line in lines[header + 1:] if "|" in line]
    names = [r[0].strip() for r in rows]
    assert any(n.startswith("select newest valid of 1000: rlsup") for n in names), names
    assert any(n.startswith("select newest valid of 1000: torch DCP") for n in names), names
    assert any(n.startswith("training step with heartbeat") for n in names), names
    assert any(n.startswith("heartbeat() call under rlsup") for n in names), names
    assert not any("failed" in n for n in names), out.stdout
    for r in rows:
        assert len(r) == 6, r
        float(r[1])  # rlsup median is a number
        float(r[2])  # baseline median is a number
    assert not list(tmp_path.iterdir()), "the scratch directory was not cleaned up"


def test_overhead_runs_every_side_and_prints_its_rows(tmp_path: Path) -> None:
    """benchmarks/bench_overhead.py at a tiny size: each side (bare torchrun, rlsup, rlsup + memory tier) runs its
    trainer to the end with no fault, and every row has both medians."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_overhead.py"), "--steps", "40", "--skip", "10",
         "--every", "10", "--width", "64", "--micro-batches", "1", "--reps", "1", "--dir", str(tmp_path)],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("no faults")]
    assert len(rows) == 8, out.stdout
    assert "trial(s) failed" not in out.stdout, out.stderr[-3000:]
    for name, rlsup, base, _ratio, unit, _note in rows:
        if unit != "% of a core":  # CPU needs the steady window's end seen before the job exits
            assert float(rlsup) > 0 and float(base) > 0, (name, rlsup, base)
    names = [r[0] for r in rows]
    assert any("rlsup defaults vs bare torchrun" in n for n in names), names
    assert any("rlsup memory tier vs bare torchrun" in n for n in names), names
    assert not list(tmp_path.iterdir()), "the scratch directory was not cleaned up"
