"""The end-to-end half of test_deploy_systemd.py (real processes, or waits on real time): systemd/: the units pass
`systemd-analyze verify` with no warning at all, and say what rlsup needs (Type=notify with a watchdog,
KillMode=mixed, a stop timeout above stop_grace, restart limits, hardening with explicit writable paths)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_deploy_systemd import UNITS, INSTALLED

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze not installed (apt-get install systemd)")


def rlsup_binary() -> str:
    path = Path(sys.executable).parent / "rlsup"
    if not path.exists():
        found = shutil.which("rlsup")
        if found is None:
            pytest.skip("no rlsup console script (pip install -e .)")
        path = Path(found)
    return str(path)


def verify(tmp_path: Path, name: str, text: str, instance: str | None = None) -> subprocess.CompletedProcess:
    (tmp_path / name).write_text(text.replace(INSTALLED, rlsup_binary()))
    target = tmp_path / (instance or name)
    return subprocess.run(["systemd-analyze", "verify", str(target)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


@needs_analyze
@pytest.mark.parametrize("name, instance", [("rlsup.service", None), ("rlsup@.service", "rlsup@llama.service")])
def test_systemd_analyze_verify_is_clean(tmp_path: Path, name: str, instance: str | None) -> None:
    r = verify(tmp_path, name, (UNITS / name).read_text(), instance)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", f"verify warned:\n{r.stdout}{r.stderr}"


@needs_analyze
def test_verify_reports_a_bad_setting(tmp_path: Path) -> None:
    """The check above is not vacuous: a misspelt value is a warning (exit 0), so output must be empty."""
    text = (UNITS / "rlsup.service").read_text().replace("KillMode=mixed", "KillMode=mixd")
    r = verify(tmp_path, "rlsup.service", text)
    assert "mixd" in r.stdout + r.stderr


