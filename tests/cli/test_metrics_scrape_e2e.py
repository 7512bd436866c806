"""Scrape real `rlsup run` processes on 127.0.0.1: a crash-and-restart on one node, and two replicating
nodes of which one is lost; the text passes `promtool check metrics`, a real Prometheus server scrapes
it and answers queries (including every Grafana panel expression), and the series exported here are
the inventory the dashboard and alert tests check their metric names against (made in tests/support/metrics.py).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from support.metrics import (dashboard_expressions, exported_series, http_get, live_prometheus, panel_expr, parse,
                             prom_query, prometheus_ready, single_node_ready, start_node, stopped_at_exit,
                             substitute, value, wait_scrape)
from support.ports import free_ports
from support.waits import wait_for


@pytest.fixture(scope="session")
def inventory(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return exported_series(tmp_path_factory.mktemp("scrapes"))


# ---------------------------------------------------------------- tests

def test_crash_and_restart_are_counted(inventory: dict[str, str]) -> None:
    s = parse(inventory["single"])
    assert value(s, "rlsup_restarts_total", reason="exit_code") == 1
    for reason in ("signal", "oom", "hang", "startup_timeout", "save_timeout", "peer_failure"):
        assert value(s, "rlsup_restarts_total", reason=reason) == 0
    assert value(s, "rlsup_attempts_total") == 2
    assert value(s, "rlsup_job_state", rlsup_job_state="running") == 1
    assert sum(v for (n, _), v in s.items() if n == "rlsup_job_state") == 1
    assert value(s, "rlsup_info", version=__import__("supervisor").__version__, node=socket.gethostname(),
                 job_name="") == 1
    assert value(s, "rlsup_checkpoint_latest_step") >= 3
    assert 0 <= value(s, "rlsup_checkpoint_age_seconds") < 120
    assert value(s, "rlsup_steps_lost_count") == 1 and value(s, "rlsup_steps_lost_sum") == 0  # crashed right after a save
    assert value(s, "rlsup_checkpoint_save_duration_seconds_count") >= 1
    assert value(s, "rlsup_checkpoint_save_duration_seconds_sum") >= 0.25  # the job's saves take >= 0.3 s
    assert value(s, "rlsup_downtime_seconds_total") > 0
    assert 0 < value(s, "rlsup_goodput_ratio") <= 1
    assert value(s, "rlsup_heartbeat_timeout_seconds") > 0


def test_replication_series_of_a_lost_peer(inventory: dict[str, str]) -> None:
    s = parse(inventory["node0"])
    assert value(s, "rlsup_replication_bytes_total", peer="1") > 0
    assert value(s, "rlsup_replication_failures_total", peer="1") >= 1
    assert value(s, "rlsup_replication_lag_seconds", peer="1") > 0
    assert value(s, "rlsup_restarts_total", reason="exit_code") == 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (scripts/install_system_deps.sh)")
def test_scrapes_pass_promtool_check_metrics(inventory: dict[str, str]) -> None:
    for name, text in inventory.items():
        r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{name}: {r.stdout}{r.stderr}"
        assert r.stdout.strip() == "" and r.stderr.strip() == "", f"{name}: promtool lint: {r.stdout}{r.stderr}"


def test_promtool_check_metrics_can_fail() -> None:
    """The check above is not vacuous: promtool rejects a counter without _total."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed")
    bad = "# HELP rlsup_restarts Restarts.\n# TYPE rlsup_restarts counter\nrlsup_restarts 1\n"
    r = subprocess.run(["promtool", "check", "metrics"], input=bad, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[tuple[str, int, subprocess.Popen]]:
    """A live `rlsup run` (crash, then running) scraped every second by a real Prometheus server that
    loads deploy/prometheus/prometheus.yml (targets rewritten) and rlsup_alerts.yml."""
    (metrics_port,) = free_ports(1)
    with live_prometheus(tmp_path, metrics_port) as base:
        with stopped_at_exit(start_node(tmp_path / "job", metrics_port, [], []), tmp_path / "job") as rlsup:
            yield base, metrics_port, rlsup


def test_prometheus_server_scrapes_rlsup(prometheus_server: tuple[str, int, subprocess.Popen]) -> None:
    base, metrics_port, rlsup = prometheus_server
    wait_for(lambda: prometheus_ready(base), 60, "Prometheus ready")
    wait_scrape(metrics_port, rlsup, "restart counted and attempt 1 heartbeating", single_node_ready)

    def restarts() -> list | None:
        r = prom_query(base, 'rlsup_restarts_total{job="rlsup", reason="exit_code"}')
        return r["data"]["result"] if r["status"] == "success" and r["data"]["result"] else None
    (series,) = wait_for(restarts, 60, "Prometheus to have scraped rlsup_restarts_total", interval=0.5)
    assert series["value"][1] == "1"
    assert series["metric"]["instance"] == f"127.0.0.1:{metrics_port}"

    targets = json.loads(http_get(f"{base}/api/v1/targets"))["data"]["activeTargets"]
    assert [t["health"] for t in targets if t["labels"]["job"] == "rlsup"] == ["up"]
    groups = json.loads(http_get(f"{base}/api/v1/rules"))["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert {r["name"] for r in rules} >= {"RlsupJobDown", "RlsupRestartStorm", "RlsupHangDetected",
                                          "RlsupCheckpointTooOld", "RlsupReplicationLagging", "RlsupGoodputLow"}
    wait_for(lambda: all(r.get("health") == "ok" for g in json.loads(http_get(f"{base}/api/v1/rules"))["data"]["groups"]
                         for r in g["rules"]), 30, "every alert rule evaluated without error", interval=0.5)

    # Every dashboard expression evaluates on real data; the node join finds this host's supervisor.
    node = socket.gethostname()
    wait_for(lambda: prom_query(base, 'count(rlsup_last_step{job="rlsup"} > 3)')["data"]["result"], 30,
             "Prometheus to have scraped attempt 1's steps", interval=0.5)
    for expr in dashboard_expressions():
        r = prom_query(base, substitute(expr, node))
        assert r["status"] == "success", f"{expr}: {r}"
    step = prom_query(base, substitute(panel_expr("Last step"), node))["data"]["result"]
    assert [x["metric"] for x in step] == [{"node": node}], step
    assert float(step[0]["value"][1]) > 3
    state = prom_query(base, substitute(panel_expr("Job state"), node))["data"]["result"]
    assert [x["metric"]["rlsup_job_state"] for x in state] == ["running"], state
