"""rlsup's metrics in tests: scraping a live ``rlsup run``, a real Prometheus server over it, and the inventory of
series real runs export (which the dashboard, alert and straggler tests check their metric names against)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from support.env import JOBS, PY, ROOT, clean_env
from support.ports import free_ports
from support.procs import kill_and_reap, rlsup_cmd
from support.waits import wait_for

JOB = [PY, str(JOBS / "metrics_job.py")]
FAST = ["--backoff-initial", "0.05", "--backoff-max", "0.2", "--kill-grace", "2", "--metrics-addr", "127.0.0.1"]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "rlsup.json"
PROM_DIR = ROOT / "deploy" / "prometheus"


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
        kill_and_reap(proc)
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
        kill_and_reap(nodes[1])
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
            kill_and_reap(proc)
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
            kill_and_reap(prom)


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
            kill_and_reap(rlsup)


def prom_query(base: str, expr: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        return json.loads(http_get(url))
    except urllib.error.HTTPError as e:  # 400 with a JSON error body for a bad expression
        return json.loads(e.read().decode())


def prometheus_ready(base: str) -> bool:
    try:
        return "Ready" in http_get(f"{base}/-/ready", timeout=1)
    except OSError:
        return False
