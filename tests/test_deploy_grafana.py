"""deploy/grafana: the dashboard parses, ids are unique, it is what the generator writes, every
expression passes promtool, and every rlsup_* name it uses is in a real scrape (and vice versa)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.env import ROOT
from support.metrics import dashboard_expressions, exported_names, substitute

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "rlsup.json"
NAME = re.compile(r"\brlsup_[a-z0-9_]+\b")
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (scripts/install_system_deps.sh)")


def all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(all_panels(p.get("panels", [])))
    return out


def metric_names(expr: str) -> set[str]:
    # rlsup_job_state is both the Enum's metric name and its label; both spellings are real.
    return set(NAME.findall(expr))


def test_dashboard_structure() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and len(dash["uid"]) <= 40 and dash["title"]
    panels = all_panels(dash["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    assert all(isinstance(i, int) and i > 0 for i in ids)
    titles = [p["title"] for p in panels if p["type"] != "row"]
    assert len(titles) == len(set(titles)), "duplicate panel titles"
    # No two panels overlap on the 24-column grid.
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        ref_ids = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert 'job=~"$job"' in t["expr"], f"{p['title']}: not templated by job"
            assert 'node=~"$node"' in t["expr"], f"{p['title']}: not templated by node"


def test_template_variables() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["query"]["query"] == "label_values(rlsup_info, job)"
    assert variables["node"]["query"]["query"] == 'label_values(rlsup_info{job=~"$job"}, node)'
    for name in ("job", "node"):
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert variables[name]["multi"] and variables[name]["includeAll"]


def test_dashboard_is_generated() -> None:
    r = subprocess.run([sys.executable, str(GRAFANA / "generate_dashboard.py"), "--check"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_provisioning_files() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["apiVersion"] == 1
    (prom,) = ds["datasources"]
    assert prom["type"] == "prometheus" and prom["uid"] and prom["url"].startswith("http")
    dashboards = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "rlsup.yml").read_text())
    assert dashboards["apiVersion"] == 1
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


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
