"""Scrape real `rlsup run` processes on 127.0.0.1: a crash-and-restart on one node, and two replicating
nodes of which one is lost; the text passes `promtool check metrics`, a real Prometheus server scrapes
it and answers queries (including every Grafana panel expression), and the series exported here are
the inventory the dashboard and alert tests check their metric names against.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from conftest import JOBS, ROOT, clean_env, free_ports, rlsup_cmd, wait_for

PY = sys.executable
JOB = [PY, str(JOBS / "metrics_job.py")]
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--metrics-addr", "127.0.0.1"]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "rlsup.json"
PROM_DIR = ROOT / "deploy" / "prometheus"


# ---------------------------------------------------------------- helpers (also used by test_deploy_*)

def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def try_scrape(port: int) -> str | None:
    try:
        return http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    except OSError:
        return None


Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def sample_names(text: str) -> set[str]:
    """Names of the samples in an exposition (histograms: _bucket/_sum/_count; prometheus_client's
    _created timestamps left out)."""
    return {name for name, _ in parse(text) if not name.endswith("_created")}


def start_node(workdir: Path, metrics_port: int, args: list[str], job_args: list[str], log: str = "rlsup.log"
               ) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    out = open(workdir / log, "ab")
    return subprocess.Popen(rlsup_cmd("run", *FAST, *args, "--", *JOB, *job_args), cwd=workdir,
                            env=clean_env(RLSUP_METRICS_PORT=str(metrics_port)), stdout=out, stderr=subprocess.STDOUT)


def wait_scrape(port: int, proc: subprocess.Popen, what: str, pred, timeout: float = 60) -> str:
    """Scrape until ``pred(samples)`` holds; fail early (with the log) if rlsup exited."""
    def check() -> str | None:
        if proc.poll() is not None:
            raise AssertionError(f"rlsup exited with {proc.returncode} while waiting for {what}")
        text = try_scrape(port)
        return text if text is not None and pred(parse(text)) else None
    return wait_for(check, timeout, what, interval=0.2)


def log_of(workdir: Path, name: str = "rlsup.log") -> str:
    path = workdir / name
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def single_node_ready(s: Samples) -> bool:
    """Attempt 0 crashed (exit 3), attempt 1 resumed from the checkpoint, heartbeats and saved since."""
    return (value(s, "rlsup_restarts_total", reason="exit_code") == 1
            and value(s, "rlsup_resumes_total", tier="local") == 1
            and (value(s, "rlsup_last_step") or 0) > 3
            and value(s, "rlsup_heartbeat_age_seconds", local_rank="0") is not None
            and (value(s, "rlsup_checkpoint_saves_total") or 0) >= 1
            and (value(s, "rlsup_resume_duration_seconds") or 0) > 0)


_INVENTORY: dict[str, str] = {}


def exported_series(root: Path) -> dict[str, str]:
    """Metrics texts of real runs, computed once per session: ``single`` (crash and restart on one
    node), ``node0`` (two replicating nodes, then node 1 lost: replication failures and lag)."""
    if _INVENTORY:
        return _INVENTORY
    # One node: crash on attempt 0, resume, train.
    port, = free_ports(1)
    d = root / "single"
    proc = start_node(d, port, ["--stop-grace", "20"], [])
    try:
        _INVENTORY["single"] = wait_scrape(port, proc, "restart counted and attempt 1 heartbeating",
                                           single_node_ready)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 143, log_of(d)  # within stop_grace + kill_grace, whatever the job does
        if "did not exit within stop_grace" in log_of(d):  # not this inventory's concern; reported, with stacks
            incidents = d / ".rlsup" / "incidents.jsonl"
            warnings.warn("metrics_job ignored rlsup's stop: " + log_of(d)
                          + (incidents.read_text()[-6000:] if incidents.exists() else ""), stacklevel=2)
    except BaseException:
        print(log_of(d))
        raise
    finally:
        kill(proc)
    # Two nodes replicating to each other; then node 1 is SIGKILLed and node 0's pushes fail.
    m0, m1, r0, r1, coord = free_ports(5)
    token = root / "token"
    token.write_text("metrics-test-shared-secret\n")
    token.chmod(0o600)
    peers = f"127.0.0.1:{r0},127.0.0.1:{r1}"
    common = ["--peers", peers, "--coordinator-port", str(coord), "--token-file", str(token),
              "--replication-scan-interval", "0.3", "--rendezvous-timeout", "60"]
    nodes = {n: start_node(root / f"node{n}", mp, [*common, "--node-rank", str(n)], ["3", "0"])
             for n, mp in ((0, m0), (1, m1))}
    try:
        for n, mp in ((0, m0), (1, m1)):
            wait_scrape(mp, nodes[n], f"node {n} replicated to its peer",
                        lambda s, p=str(1 - n): (value(s, "rlsup_replication_bytes_total", peer=p) or 0) > 0, 90)
        kill(nodes[1])
        _INVENTORY["node0"] = wait_scrape(
            m0, nodes[0], "node 0's transfers to the lost node 1 failing",
            lambda s: (value(s, "rlsup_replication_failures_total", peer="1") or 0) >= 1
            and (value(s, "rlsup_replication_lag_seconds", peer="1") or 0) > 0, 60)
    except BaseException:
        for n in nodes:
            print(f"--- node {n} ---\n" + log_of(root / f"node{n}"))
        raise
    finally:
        for proc in nodes.values():  # SIGKILL: a graceful stop would drain replication to the dead peer
            kill(proc)
    return _INVENTORY


def exported_names(root: Path) -> set[str]:
    names: set[str] = set()
    for text in exported_series(root).values():
        names |= sample_names(text)
    return names


def dashboard_expressions() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets, annotations, template variable queries
    (``label_values(metric, label)`` turned into the selector it reads)."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            exprs.append(t["expr"])
    for a in dash["annotations"]["list"]:
        if "expr" in a:
            exprs.append(a["expr"])
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            assert q.startswith("label_values(") and q.endswith(")"), q
            exprs.append(q[len("label_values("):-1].rpartition(",")[0].strip())
    return exprs


def panel_expr(title: str) -> str:
    (panel,) = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == title]
    return panel["targets"][0]["expr"]


def substitute(expr: str, node: str = "node1") -> str:
    """Grafana's template variables replaced with values Prometheus accepts."""
    for var, val in (("$__rate_interval", "20s"), ("$__range", "5m"), ("$__interval", "15s"),
                     ("$job", "rlsup"), ("${job}", "rlsup"), ("$node", node), ("${node}", node)):
        expr = expr.replace(var, val)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


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


@contextmanager
def live_prometheus(tmp_path: Path, metrics_port: int, rule_files: list[str] | None = None) -> Iterator[str]:
    """A real Prometheus server (its base URL) loading deploy/prometheus/prometheus.yml with the rlsup
    target rewritten to ``metrics_port``, scraping and evaluating every second; ``rule_files``: instead of
    the deployed rlsup_alerts.yml. Skips the test where prometheus is not installed."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus server not installed (scripts/install_system_deps.sh)")
    (prom_port,) = free_ports(1)
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = rule_files or [str(PROM_DIR / f) for f in cfg["rule_files"]]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "rlsup"]
    job["scrape_interval"] = "1s"
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    with open(tmp_path / "prometheus.log", "ab") as prom_log:
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=prom_log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        yield f"http://127.0.0.1:{prom_port}"
    except BaseException:
        print((tmp_path / "prometheus.log").read_text()[-3000:])
        raise
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=30)
        finally:
            kill(prom)


@contextmanager
def stopped_at_exit(rlsup: subprocess.Popen, workdir: Path) -> Iterator[subprocess.Popen]:
    """SIGTERM ``rlsup`` when the block ends (killed if it outlives 60 s); its log printed on failure."""
    try:
        yield rlsup
    except BaseException:
        print(log_of(workdir))
        raise
    finally:
        rlsup.send_signal(signal.SIGTERM)
        try:
            rlsup.wait(timeout=60)
        finally:
            kill(rlsup)


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[tuple[str, int, subprocess.Popen]]:
    """A live `rlsup run` (crash, then running) scraped every second by a real Prometheus server that
    loads deploy/prometheus/prometheus.yml (targets rewritten) and rlsup_alerts.yml."""
    (metrics_port,) = free_ports(1)
    with live_prometheus(tmp_path, metrics_port) as base:
        with stopped_at_exit(start_node(tmp_path / "job", metrics_port, [], []), tmp_path / "job") as rlsup:
            yield base, metrics_port, rlsup


def prom_query(base: str, expr: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        return json.loads(http_get(url))
    except urllib.error.HTTPError as e:  # 400 with a JSON error body for a bad expression
        return json.loads(e.read().decode())


def test_prometheus_server_scrapes_rlsup(prometheus_server: tuple[str, int, subprocess.Popen]) -> None:
    base, metrics_port, rlsup = prometheus_server
    wait_for(lambda: _ready(base), 60, "Prometheus ready")
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


def _ready(base: str) -> bool:
    try:
        return "Ready" in http_get(f"{base}/-/ready", timeout=1)
    except OSError:
        return False
