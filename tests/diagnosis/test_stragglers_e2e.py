"""The end-to-end half of test_stragglers.py (real processes, or waits on real time): stragglers (issue 19): a rank
whose own work stays slower than its peers' is reported, with the metric and the alert."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.env import JOBS, clean_env
from support.ports import free_ports
from support.metrics import (PROM_DIR, http_get, live_prometheus, log_of, parse, prometheus_ready, stopped_at_exit,
                             try_scrape, value)
from support.procs import kill_and_reap, rlsup_cmd
from support.waits import wait_for
from supervisor.membership import node_name
from rlsup_format.state_files import STRAGGLERS

PY = sys.executable


def start(workdir: Path, metrics_port: int, mode: str, steps: int) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    out = open(workdir / "rlsup.log", "ab")
    # --max-restarts 0: these runs never restart, so no launcher is armed for a next attempt; attempt 0 starts from
    # rlsup's default, a launcher whose 4 ranks are forked from its one torch import
    cmd = rlsup_cmd("run", "--metrics-addr", "127.0.0.1", "--straggler-window", "8", "--max-restarts", "0", "--",
                    PY, "-m",
                    "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(JOBS / "straggler_job.py"),
                    str(steps), mode)
    return subprocess.Popen(cmd, cwd=workdir, env=clean_env(RLSUP_METRICS_PORT=str(metrics_port)), stdout=out,
                            stderr=subprocess.STDOUT)


@pytest.mark.parametrize("mode", ["arrival", "work"])
def test_four_rank_job_with_a_3x_slow_rank_is_reported(tmp_path: Path, mode: str) -> None:
    port, = free_ports(1)
    proc = start(tmp_path, port, mode, 60)
    try:
        def flagged() -> dict | None:
            text = try_scrape(port)
            s = parse(text) if text else None
            return s if s and value(s, "rlsup_stragglers") == 1 else None
        s = wait_for(flagged, 120, "rlsup_stragglers to show the slow rank", interval=0.2)
        assert value(s, "rlsup_straggler_ratio", local_rank="2") > 2.0
        assert value(s, "rlsup_suspect_total", node=node_name(), why="straggler") == 1
        assert proc.wait(timeout=120) == 0, log_of(tmp_path)
    finally:
        kill_and_reap(proc)
    reports = [json.loads(line) for line in (tmp_path / ".rlsup" / STRAGGLERS).read_text().splitlines()]
    first = reports[0]
    assert (first["rank"], first["cleared"], first["node"]) == (2, False, node_name()), reports
    assert first["method"] == ("work_section" if mode == "work" else "arrival")
    assert first["step"] <= 36 and first["ratio"] > 2.0, first  # within a few dozen steps
    assert not any(r["rank"] != 2 for r in reports), reports  # nobody else is named
    assert f"straggler: rank 2 (pid {first['pid']}) on node {node_name()}" in log_of(tmp_path)
    triage = subprocess.run(rlsup_cmd("incidents", str(tmp_path / ".rlsup")), capture_output=True, text=True,
                            timeout=60, env=clean_env())
    assert f"straggler: rank 2 (pid {first['pid']})" in triage.stdout, triage.stdout + triage.stderr


def test_straggler_alert_fires_in_a_real_prometheus(tmp_path: Path) -> None:
    (metrics_port,) = free_ports(1)
    rules = yaml.safe_load((PROM_DIR / "rlsup_alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "RlsupStraggler":
                rule.pop("for")  # the 2 minutes pending are promtool-tested; here: the expression on real data
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    with live_prometheus(tmp_path, metrics_port, [str(tmp_path / "rules.yml")]) as base:
        with stopped_at_exit(start(tmp_path / "job", metrics_port, "arrival", 400), tmp_path / "job"):
            wait_for(lambda: prometheus_ready(base), 60, "Prometheus ready")

            def firing() -> list | None:
                alerts = json.loads(http_get(f"{base}/api/v1/alerts"))["data"]["alerts"]
                hits = [a for a in alerts if a["labels"]["alertname"] == "RlsupStraggler" and a["state"] == "firing"]
                return hits or None
            (alert,) = wait_for(firing, 150, "RlsupStraggler to fire", interval=0.5)
            assert alert["labels"]["instance"] == f"127.0.0.1:{metrics_port}"
