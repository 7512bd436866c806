"""The end-to-end half of test_format.py (real processes, or waits on real time): rlsup_format in-process: reserved
names round-trip, the one leftover rule, the one retention rule."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


from rlsup_format.leftovers import STALE_AGE_S, clean_leftovers
from rlsup_format.names import Kind, host_tag, reserved_name


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _plant(directory: Path, kind: Kind, host: str, pid: int, age: float = 0.0, is_dir: bool = False) -> Path:
    path = directory / f".{kind.value}-lbl-{host}-{pid}-abcd"
    if is_dir:
        path.mkdir()
        (path / "inner").write_bytes(b"x")
    else:
        path.write_bytes(b"x")
    if age:
        t = time.time() - age
        os.utime(path, (t, t))
    return path


def test_leftovers_rule(tmp_path: Path) -> None:
    dead, alive = _dead_pid(), os.getppid()
    gone = [_plant(tmp_path, Kind.STAGING, host_tag(), dead, is_dir=True),
            _plant(tmp_path, Kind.TMP, host_tag(), dead),
            _plant(tmp_path, Kind.HOLD, host_tag(), dead),
            _plant(tmp_path, Kind.TMP, "otherhost", alive, age=STALE_AGE_S + 10)]
    kept = [_plant(tmp_path, Kind.TMP, host_tag(), alive),                       # a live writer here
            _plant(tmp_path, Kind.TMP, "otherhost", dead),                       # cannot check: too young
            _plant(tmp_path, Kind.HOLD, "otherhost", alive, age=STALE_AGE_S + 10),  # a long copy elsewhere
            tmp_path / reserved_name(Kind.TMP, "mine")]                          # this very process
    kept[-1].write_bytes(b"x")
    (tmp_path / "step_000000001").mkdir()
    removed = clean_leftovers(tmp_path)
    assert sorted(removed) == sorted(gone)
    assert all(p.exists() for p in kept) and (tmp_path / "step_000000001").exists()


def test_leftovers_recursive_and_by_kind(tmp_path: Path) -> None:
    dead = _dead_pid()
    step = tmp_path / "step_000000002" / "sub"
    step.mkdir(parents=True)
    nested = _plant(step, Kind.TMP, host_tag(), dead)
    hold = _plant(tmp_path / "step_000000002", Kind.HOLD, host_tag(), dead)
    assert clean_leftovers(tmp_path, kinds={Kind.TMP}) == []
    assert clean_leftovers(tmp_path, kinds={Kind.TMP}, recursive=True) == [nested]
    assert hold.exists()


