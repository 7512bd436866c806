"""benchmarks/bench_scale.py runs at small sizes and its figures are sane: every simulated node agreed
on the same plan, the plan model picks the right step, and a restore's bytes per node do not grow with
the number of nodes. No timed assertions (performance is never asserted in tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.env import ROOT, clean_env
from etcd_cluster import etcd_binary

SCRIPT = ROOT / "benchmarks" / "bench_scale.py"


def run_harness(tmp_path: Path, *args: str) -> dict:
    out_json = tmp_path / "scale.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--procs", "2", "--rounds", "2", "--dir",
                          str(tmp_path), "--json", str(out_json), "--markdown", str(tmp_path / "scale.md"), *args],
                         cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(out_json.read_text())
    assert data["rows"], out.stdout
    for row in data["rows"]:
        assert "failed" not in row["name"] and "WRONG" not in row["note"], row
        assert row["rlsup"] is not None and row["rlsup"] > 0, row
    table = (tmp_path / "scale.md").read_text()
    assert table.startswith("| figure | rlsup median |") and len(table.splitlines()) == len(data["rows"]) + 2
    return data


def test_agreement_plan_and_bytes_at_small_sizes(tmp_path: Path) -> None:
    data = run_harness(tmp_path, "--sizes", "8", "--backends", "embedded", "--byte-sizes", "4,8")

    (agreed,) = data["agreement"]
    assert (agreed["backend"], agreed["nodes"]) == ("embedded", 8)
    # Every round: all 8 nodes in the same round, the same plan (newest step, the lost node's 8 parts from
    # its replica holder) and the same resume step; otherwise the harness raises and the row says failed.
    assert agreed["plan_ok"] and len(agreed["times"]) == 2 and all(t > 0 for t in agreed["times"])
    assert agreed["baseline"] is not None and agreed["baseline"] > 0  # the bare TCPStore exchange ran too

    plan = data["plan"]
    assert plan["ok"] and plan["median"] > 0 and plan["inventory_bytes"] > 800  # 8 ranks x 5 steps, twice

    small, large = data["bytes"]
    assert (small["nodes"], large["nodes"]) == (4, 8)
    for r in (small, large):
        assert r["ok"], r  # one plan, one round, and the lost node resumed from the newest step
        per_node = {int(n): v for n, v in r["per_node"].items()}
        lost, holder = r["lost"], r["holder"]
        assert per_node[lost]["data_recv"] >= r["payload"]  # it got its parts back ...
        assert per_node[holder]["data_sent"] >= r["payload"]  # ... from its replica holder ...
        assert r["other_data"] == 0  # ... and no other node moved a byte of data
        assert r["max_coord"] > 0 and sum(r["host"]) > 0
    # What a node sends and receives does not grow with the number of nodes (job names and key
    # numbers are a few characters longer at 8; coordination polls vary with timing).
    assert large["max_data"] <= small["max_data"] * 1.02
    assert large["max_coord"] <= small["max_coord"] * 2
    assert sum(large["host"]) > sum(small["host"])  # the embedded store's host serves everyone


@pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (Debian/Ubuntu package etcd-server)")
def test_agreement_through_etcd(tmp_path: Path) -> None:
    data = run_harness(tmp_path, "--only", "agreement", "--sizes", "4", "--backends", "etcd")
    (agreed,) = data["agreement"]
    assert (agreed["backend"], agreed["nodes"], agreed["baseline"]) == ("etcd", 4, None)
    assert agreed["plan_ok"] and len(agreed["times"]) == 2
    assert agreed["server_cpu"] >= 0
