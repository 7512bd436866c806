"""deploy/prometheus: the scrape config and alert rules pass promtool, the rules' unit tests pass (and
fail when a rule is broken), every alert is tested, and every series the rules read is exported."""

from __future__ import annotations

from pathlib import Path

import yaml

from support.env import ROOT

PROM = ROOT / "deploy" / "prometheus"
RULES = PROM / "rlsup_alerts.yml"
UNIT_TESTS = sorted((PROM / "tests").glob("*.yml"))
EXPECTED_ALERTS = {"RlsupJobDown", "RlsupRestartStorm", "RlsupHangDetected", "RlsupCheckpointTooOld",
                   "RlsupReplicationLagging", "RlsupReplicationFailing", "RlsupGoodputLow", "RlsupStraggler",
                   "RlsupTierStalled"}


def alert_rules(path: Path = RULES) -> list[dict]:
    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def test_example_config_scrapes_rlsup_port() -> None:
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "rlsup"]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets and all(t.endswith(":9778") for t in targets)
    assert cfg["rule_files"] == ["rlsup_alerts.yml"]


def test_every_alert_has_a_firing_unit_test() -> None:
    assert {r["alert"] for r in alert_rules()} == EXPECTED_ALERTS
    firing, quiet = set(), set()
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                (firing if t.get("exp_alerts") else quiet).add(t["alertname"])
    assert EXPECTED_ALERTS - firing == set(), "alerts without a test where they fire"
    assert EXPECTED_ALERTS - {"RlsupReplicationFailing"} - quiet == set(), "alerts without a test where they stay quiet"


