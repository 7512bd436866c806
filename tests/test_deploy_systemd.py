"""systemd/: the units pass `systemd-analyze verify` with no warning at all, and say what rlsup needs
(Type=notify with a watchdog, KillMode=mixed, a stop timeout above stop_grace, restart limits,
hardening with explicit writable paths). systemd itself need not run: verify only loads the files.

verify fails when ExecStart's binary does not exist, so the test copies each unit into a temporary
directory with ExecStart's /usr/local/bin/rlsup rewritten to this environment's `rlsup` (the venv's
console script next to sys.executable).
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.env import ROOT
from supervisor.config import SupervisorConfig, load_config

UNITS = ROOT / "systemd"
INSTALLED = "/usr/local/bin/rlsup"
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


def unit(name: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=True, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # keys are case-sensitive
    cp.read_string((UNITS / name).read_text())
    return cp


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


def test_daemon_unit_settings() -> None:
    u = unit("rlsup.service")
    s = u["Service"]
    assert s["ExecStart"] == f"{INSTALLED} daemon --config /etc/rlsup/rlsup.yaml"
    assert s["Type"] == "notify" and s["NotifyAccess"] == "main"
    assert int(s["WatchdogSec"]) >= 10
    assert s["KillMode"] == "mixed" and s["Restart"] == "on-failure"
    defaults = SupervisorConfig()
    assert int(s["TimeoutStopSec"]) > defaults.stop_grace + defaults.kill_grace
    assert int(u["Unit"]["StartLimitBurst"]) >= 1 and int(u["Unit"]["StartLimitIntervalSec"]) > 0
    for key, want in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("PrivateTmp", "yes"),
                      ("ProtectHome", "read-only")):
        assert s[key] == want, key
    assert s["StateDirectory"] == "rlsup" and s["ReadWritePaths"]


def test_job_template_settings() -> None:
    u = unit("rlsup@.service")
    s = u["Service"]
    assert s["ExecStart"].startswith(f"{INSTALLED} run --config /etc/rlsup/%i.yaml ")
    assert s["KillMode"] == "mixed" and "76" in s["RestartPreventExitStatus"].split()
    assert int(s["TimeoutStopSec"]) > SupervisorConfig().stop_grace + SupervisorConfig().kill_grace
    assert s["NoNewPrivileges"] == "yes" and s["ProtectSystem"] == "strict"
    assert "PrivateDevices" not in s  # GPUs must stay visible to training jobs
    assert s["Delegate"] == "yes" and "ProtectControlGroups" not in s  # a cgroup per job root, below rlsup's


def test_example_config_loads_and_matches_sandbox() -> None:
    cfg = load_config(None, environ={"RLSUP_CONFIG": str(UNITS / "rlsup.yaml")}).config
    writable = ["/var/lib/rlsup"] + [p.lstrip("-") for p in unit("rlsup.service")["Service"]["ReadWritePaths"].split()]
    for key in ("state_dir", "replica_dir", "checkpoint_dir"):
        path = getattr(cfg, key)
        assert any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable), \
            f"{key}={path} is read-only inside the unit's sandbox"
    assert cfg.metrics_port == 9778 and cfg.peers and cfg.node_rank is not None
