"""The end-to-end half of test_deploy_prometheus.py (real processes, or waits on real time): deploy/prometheus: the
scrape config and alert rules pass promtool, the rules' unit tests pass (and fail when a rule is broken), every
alert is tested, and every series the rules read is exported."""

from __future__ import annotations

import re

import pytest

from supervisor.cli.metrics import REASONS, STATES
from support.metrics import exported_names
from test_deploy_prometheus import alert_rules
import shutil
import subprocess
from pathlib import Path
import yaml
from test_deploy_prometheus import PROM, RULES, UNIT_TESTS


def test_rules_read_only_exported_series(tmp_path_factory: pytest.TempPathFactory) -> None:
    exported = exported_names(tmp_path_factory.mktemp("scrapes"))
    for rule in alert_rules():
        names = set(re.findall(r"\brlsup_[a-z0-9_]+\b", rule["expr"]))
        assert names, rule["alert"]
        assert names - exported == set(), f"{rule['alert']} reads series rlsup does not export: {names - exported}"
        for state in re.findall(r'rlsup_job_state=~?"([^"]+)"', rule["expr"]):
            assert set(state.split("|")) <= set(STATES), (rule["alert"], state)
        for reasons in re.findall(r'reason=~?"([^"]+)"', rule["expr"]):
            assert set(reasons.split("|")) <= set(REASONS), (rule["alert"], reasons)


needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (scripts/install_system_deps.sh)")


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@needs_promtool
def test_config_and_rules_pass_promtool() -> None:
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    r = promtool("check", "rules", "rlsup_alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout


@needs_promtool
def test_rule_unit_tests_pass() -> None:
    assert UNIT_TESTS
    r = promtool("test", "rules", *[p.name for p in UNIT_TESTS], cwd=PROM / "tests")
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
@pytest.mark.parametrize("alert, old, new", [
    ("RlsupHangDetected", 'reason=~"hang|startup_timeout|save_timeout"', 'reason=~".+"'),  # would page on crashes
    ("RlsupRestartStorm", ">= 3", ">= 4"),
    ("RlsupCheckpointTooOld", 'rlsup_job_state{rlsup_job_state="running"} == 1', "rlsup_job_state >= 0"),
    ("RlsupGoodputLow", "30m", "10m"),
    ("RlsupStraggler", "> 0", ">= 0"),  # would fire on every healthy node
    ("RlsupTierStalled", "5m", "1m"),  # would page on a slow store's passing stall
])
def test_unit_tests_catch_a_broken_rule(tmp_path: Path, alert: str, old: str, new: str) -> None:
    """The unit tests are not vacuous: each mutation of a rule makes them fail."""
    doc = yaml.safe_load(RULES.read_text())
    (rule,) = [r for g in doc["groups"] for r in g["rules"] if r.get("alert") == alert]
    field = "for" if old.endswith("m") and old[:-1].isdigit() else "expr"
    assert old in rule[field], (alert, rule[field])
    rule[field] = rule[field].replace(old, new)
    (tmp_path / "tests").mkdir()
    (tmp_path / "rlsup_alerts.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    for p in UNIT_TESTS:
        shutil.copy(p, tmp_path / "tests" / p.name)
    assert promtool("check", "rules", "rlsup_alerts.yml", cwd=tmp_path).returncode == 0
    r = promtool("test", "rules", *[p.name for p in UNIT_TESTS], cwd=tmp_path / "tests")
    assert r.returncode != 0, f"mutating {alert} ({old} -> {new}) went unnoticed"
    assert alert in r.stdout + r.stderr

