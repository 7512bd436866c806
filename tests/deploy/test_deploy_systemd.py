"""systemd/: the units pass `systemd-analyze verify` with no warning at all, and say what rlsup needs
(Type=notify with a watchdog, KillMode=mixed, a stop timeout above stop_grace, restart limits,
hardening with explicit writable paths). systemd itself need not run: verify only loads the files.

verify fails when ExecStart's binary does not exist, so the test copies each unit into a temporary
directory with ExecStart's /usr/local/bin/rlsup rewritten to this environment's `rlsup` (the venv's
console script next to sys.executable).
"""

from __future__ import annotations

import configparser


from support.env import ROOT
from supervisor.config import SupervisorConfig, load_config

UNITS = ROOT / "systemd"
INSTALLED = "/usr/local/bin/rlsup"


def unit(name: str) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=True, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # keys are case-sensitive
    cp.read_string((UNITS / name).read_text())
    return cp


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
