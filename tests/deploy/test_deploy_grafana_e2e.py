"""The end-to-end half of test_deploy_grafana.py (real processes, or waits on real time): deploy/grafana: the
dashboard parses, ids are unique, it is what the generator writes, every expression passes promtool, and every
rlsup_* name it uses is in a real scrape (and vice versa)."""

from __future__ import annotations

import re

import pytest

from support.metrics import dashboard_expressions, exported_names
import shutil
import subprocess
import sys
from pathlib import Path
import yaml
from support.metrics import substitute
from test_deploy_grafana import GRAFANA

NAME = re.compile(r"\brlsup_[a-z0-9_]+\b")


def metric_names(expr: str) -> set[str]:
    # rlsup_job_state is both the Enum's metric name and its label; both spellings are real.
    return set(NAME.findall(expr))


def test_metric_names_exist_in_a_real_scrape(tmp_path_factory: pytest.TempPathFactory) -> None:
    used: set[str] = set()
    for expr in dashboard_expressions():
        used |= metric_names(expr)
    exported = exported_names(tmp_path_factory.mktemp("scrapes"))
    assert used - exported == set(), f"dashboard uses series rlsup does not export: {sorted(used - exported)}"
    # ...and the dashboard shows every series rlsup exports (histograms through any of their series).
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}
    shown = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
    assert families - shown == set(), f"exported but not on the dashboard: {sorted(families - shown)}"


needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (scripts/install_system_deps.sh)")


def test_dashboard_is_generated() -> None:
    r = subprocess.run([sys.executable, str(GRAFANA / "generate_dashboard.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def promtool_check_exprs(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"rlsup_dashboard:expr{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_every_expression_passes_promtool(tmp_path: Path) -> None:
    exprs = [substitute(e) for e in dashboard_expressions()]
    assert len(exprs) > 20
    r = promtool_check_exprs(exprs, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in r.stdout


@needs_promtool
def test_promtool_expression_check_can_fail(tmp_path: Path) -> None:
    r = promtool_check_exprs([substitute('sum by (node) (rate(rlsup_attempts_total{job=~"$job"}))')], tmp_path)
    assert r.returncode != 0  # a range function without a range

